"""Load a causal LM from local files only (found by `model_files.py`, never a hub download).

A model the fused decoder covers loads without transformers' model classes (see `model_config.py`);
others load as the stock transformers model.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.model.awq import open_awq
from kvloom.engine.model.compressed_tensors import open_compressed
from kvloom.engine.model.integer_weights import IntegerCheckpoint
from kvloom.engine.model.gptq import open_gptq
from kvloom.engine.model.decoder import FusedDecoder
from kvloom.engine.model.fast_tokenizer import load_fast_tokenizer
from kvloom.engine.errors import ConfigError, ModelLoadError
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.model.quantized_weights import BlockSource, QuantizedWeights
from kvloom.engine.model.stock_decoder import StockDecoder
from kvloom.engine.tensor_parallel.tp_group import TensorParallelGroup
from kvloom.engine.tensor_parallel.tp_shards import RankShard, ShardedCheckpoint
from kvloom.kernels.fp8_linear import fp8_unsupported

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path, config: ModelConfig | None = None):
    """The model's tokenizer (fast_tokenizer.py: transformers' only for a folder without tokenizer.json)."""
    config = config or ModelConfig.from_dir(model_dir)
    try:
        return load_fast_tokenizer(model_dir, config)
    except Exception as exc:  # `tokenizers` raises a bare Exception for a file it cannot parse
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def eos_token_ids(config: ModelConfig, tokenizer) -> set[int]:
    """The ids that end a generation: the model's (generation) config's and the tokenizer's own."""
    ids = set(config.eos_token_ids)
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return ids


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
    return LoadedModel(config, tokenizer, load_decoder(model_dir, config, dtype, device, model_impl))


# quant_method -> its reader
INTEGER_CHECKPOINTS = {"compressed-tensors": open_compressed, "awq": open_awq, "gptq": open_gptq}


def open_checkpoint(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Checkpoint | None:
    """The model's safetensors checkpoint, read through its integer weights where config.json's
    `quantization_config` names a format kvloom reads as stored (compressed-tensors, AWQ, GPTQ)."""
    checkpoint = Checkpoint.open(config.model_dir, dtype, device)
    quantization = config.raw.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if checkpoint is None or method is None:
        return checkpoint
    if method not in INTEGER_CHECKPOINTS:
        raise ModelLoadError(f"{config.model_dir}: quantization_config's quant_method {method!r} is not one kvloom "
                             f"reads ({', '.join(INTEGER_CHECKPOINTS)})")
    return INTEGER_CHECKPOINTS[method](checkpoint, quantization)


def quantized_weights(model_dir: Path, checkpoint: Checkpoint, quantization: str | None) -> BlockSource | None:
    """The GGUF blocks the decoder runs as stored: a GGUF model's for `quantization: gguf` (or gguf-int8); an
    integer checkpoint's (compressed-tensors, AWQ, GPTQ) unless `quantization` asks for fp8."""
    if isinstance(checkpoint, IntegerCheckpoint):
        if quantization not in (None, checkpoint.method, "fp8"):
            raise ConfigError("quantization", f"{model_dir} is a {checkpoint.method} checkpoint: leave quantization "
                                              f"unset or set it to {checkpoint.method} (or fp8)")
        return checkpoint if quantization != "fp8" else None
    if quantization in (None, "fp8"):
        return None
    if quantization in INTEGER_CHECKPOINTS:
        raise ConfigError("quantization", f"{model_dir} is not a {quantization} checkpoint (its config.json's "
                                          "quantization_config does not say so)")
    quantized = QuantizedWeights.open(model_dir, int8=quantization == "gguf-int8")
    if quantized is None:
        raise ConfigError("quantization", f"{model_dir} was not converted from a GGUF file: it has no quantized "
                                          "weights to run as stored")
    return quantized


def load_shard_decoder(model_dir: Path, config: ModelConfig, shard: RankShard, group: TensorParallelGroup,
                       dtype: torch.dtype, device: torch.device) -> FusedDecoder:
    """One tensor-parallel rank's decoder, holding only its slices of the weights (see tp_shards.py)."""
    checkpoint = open_checkpoint(config, dtype, device)
    if isinstance(checkpoint, IntegerCheckpoint):
        logger.info("quantization %s: tensor-parallel ranks run its linears de-quantized", checkpoint.method)
    reason = FusedDecoder.unsupported(config, checkpoint)
    if reason is not None:
        raise ConfigError("tensor_parallel_size", f"tensor parallelism runs kvloom's fused decoder, which does not "
                                                  f"cover this model ({reason})")
    return FusedDecoder(shard.local_config(config), ShardedCheckpoint(checkpoint, shard, config), group)


def load_decoder(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 model_impl: str, quantization: str | None = None) -> FusedDecoder | StockDecoder:
    """kvloom's fused decoder where it covers the model (and `model_impl` allows), else the stock one;
    `quantization: gguf` needs the fused one and a model converted from a GGUF file; `fp8` the fused one on a device
    with an FP8 matrix multiply."""
    if quantization == "fp8" and (why := fp8_unsupported(device)) is not None:
        raise ConfigError("quantization", why)
    if model_impl != "transformers":
        checkpoint = open_checkpoint(config, dtype, device)
        reason = FusedDecoder.unsupported(config, checkpoint)
        if reason is None:
            quantized = quantized_weights(model_dir, checkpoint, quantization)
            decoder = FusedDecoder(config, checkpoint, quantized=quantized, fp8=quantization == "fp8")
            if quantized is not None:
                quantized.log_inflated()
            return decoder
        if model_impl == "kvloom":
            raise ConfigError("model_impl", f"kvloom's fused decoder does not cover this model ({reason}); "
                                            "use auto or transformers")
        if quantization is not None or isinstance(checkpoint, IntegerCheckpoint):
            raise ConfigError("quantization", f"quantized weights run in kvloom's fused decoder, which does not "
                                              f"cover this model ({reason})")
    elif quantization is not None:
        raise ConfigError("quantization", "quantized weights run in kvloom's fused decoder, not model_impl "
                                          "transformers")
    try:
        return StockDecoder.load(model_dir, dtype, device)
    except (OSError, ValueError, SafetensorError) as exc:  # a truncated weights file raises SafetensorError
        raise ModelLoadError(f"cannot load model from {model_dir}: {exc}") from exc
