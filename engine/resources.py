"""What an engine runs on and with: its device, its dtypes, and how many KV blocks its budget holds."""

import logging
from collections.abc import Callable

import torch

from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.request import Request
from kvloom.engine.runner import ModelRunner
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.host_isa import HostISA, auto_cpu_dtype, host_isa

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
        logger.info("kvloom engine runs on %s%s", requested,
                    "" if requested == "cuda" else " (no CUDA device visible)")
    elif requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda requested but no CUDA device is visible")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device, isa: HostISA | None = None) -> torch.dtype:
    """The engine's dtype; `auto` asks the hardware (and says what it found, once per engine)."""
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        chosen, reason = ("bfloat16", "CUDA device") if bf16 else ("float16", "CUDA device without bfloat16")
    else:
        isa = isa or host_isa()
        chosen = auto_cpu_dtype(isa)
        reason = isa.describe() + (": bfloat16 in hardware" if isa.fast_bfloat16 else
                                   ": bfloat16 weights widened in registers" if chosen == "bfloat16" else
                                   ": no bfloat16 units")
    logger.info("kvloom engine dtype %s (auto; %s)", chosen, reason)
    return DTYPES[chosen]


def resolve_kv_dtype(requested: str, dtype: torch.dtype) -> torch.dtype:
    """`auto`: the model's dtype."""
    return dtype if requested == "auto" else DTYPES[requested]


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """`max_model_len`, by default the model's context length, which it may not exceed."""
    context_length = model_config.max_position_embeddings
    max_model_len = config.max_model_len or context_length
    if max_model_len > context_length:
        raise ConfigError("max_model_len", f"{max_model_len} exceeds the model's context length ({context_length})")
    return max_model_len


def check_batch_limits(config: EngineConfig, max_model_len: int) -> None:
    """A step budget every request can be scheduled within."""
    if config.max_num_batched_tokens < config.max_num_seqs:
        raise ConfigError("max_num_batched_tokens", f"must be >= max_num_seqs ({config.max_num_seqs})")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            "max_num_batched_tokens",
            f"without chunked prefill it must be >= max_model_len ({max_model_len}), "
            "or a long prompt could never be scheduled",
        )


def kv_block_count(config: EngineConfig, device: torch.device, bytes_per_token: int, max_model_len: int,
                   profile_cuda_budget: Callable[[], int]) -> int:
    """How many blocks the KV budget holds: `kv_cache_memory_bytes`, else on CUDA what the utilization target
    leaves after a profiled forward, else DEFAULT_CPU_KV_BYTES. At least one max-length request must fit."""
    block_bytes = bytes_per_token * config.block_size
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda" and config.tensor_parallel_size > 1:
            raise ConfigError("kv_cache_memory_bytes", "set each rank's KV budget for tensor parallelism on "
                                                       "CUDA (the memory profile runs one device's forward)")
        budget = profile_cuda_budget() if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    num_blocks = budget // block_bytes
    needed = -(-max_model_len // config.block_size)
    if num_blocks < needed:
        raise ConfigError(
            "kv_cache_memory_bytes",
            f"budget of {budget} bytes holds {num_blocks} blocks of {config.block_size} tokens "
            f"({block_bytes} bytes each), but one max-length request ({max_model_len} tokens) "
            f"needs {needed}: raise the budget or lower max_model_len",
        )
    return int(num_blocks)


def profile_cuda_budget(config: EngineConfig, device: torch.device, make_runner: Callable[[int], ModelRunner]) -> int:
    """KV budget on CUDA: the utilization target minus the peak of a max-size forward (on a runner with just the
    blocks that forward needs)."""
    tokens = config.max_num_batched_tokens
    blocks = -(-tokens // config.block_size)
    torch.cuda.reset_peak_memory_stats(device)
    runner = make_runner(blocks)
    probe = Request("profile", [0] * tokens, SamplingParams(max_tokens=1, temperature=0))
    probe.block_ids = list(range(blocks))
    runner.execute([(probe, tokens)])
    peak = torch.cuda.max_memory_allocated(device)
    del runner
    torch.cuda.empty_cache()
    budget = int(torch.cuda.get_device_properties(device).total_memory * config.gpu_memory_utilization) - peak
    if budget <= 0:
        raise ConfigError("gpu_memory_utilization", f"leaves no room for KV after a {peak}-byte peak")
    return budget
