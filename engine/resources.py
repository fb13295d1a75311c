"""What an engine runs on and with: its device, its dtypes, and how many KV blocks its budget holds."""

import gc
import logging
from collections.abc import Callable

import torch

from kvloom.engine.config import EngineConfig
from kvloom.engine.cuda_graphs import captures_graphs
from kvloom.engine.errors import ConfigError
from kvloom.engine.kv_budget import DeviceMemory, GiB, kv_budget_bytes, worst_step_lengths
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
    leaves once the rest is measured (`profile_cuda_budget`), else DEFAULT_CPU_KV_BYTES. At least one max-length
    request must fit."""
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


# the most demanding sampling a step may ask of every row: the full sort of top-p, top-k on top, the most logprobs,
# and every prompt row through the LM head for prompt logprobs (SamplingParams' largest counts)
WORST_SAMPLING = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, logprobs=20, prompt_logprobs=20)
PLAIN_PASS = SamplingParams(max_tokens=1, temperature=0)  # a draft's pass: the last rows' logits only


def probe_step(lengths: list[int], block_size: int, params: SamplingParams) -> tuple[list[tuple[Request, int]], int]:
    """A step computing prompts of these lengths whole (so every one is sampled), and the blocks they hold."""
    step, blocks = [], 0
    for i, length in enumerate(lengths):
        request = Request(f"profile-{i}", [0] * length, params)
        held = -(-length // block_size)
        request.block_ids = list(range(blocks, blocks + held))
        blocks += held
        step.append((request, length))
    return step, blocks


def release(cuda) -> None:
    """Hand what dropped probes held back to the device (runners hold reference cycles)."""
    gc.collect()
    cuda.empty_cache()


def peak_bytes(cuda, device: torch.device, run: Callable[[], object]) -> int:
    """What `run` allocates at its peak beyond what is allocated before it."""
    cuda.reset_peak_memory_stats(device)
    before = cuda.memory_allocated(device)
    run()
    return cuda.max_memory_allocated(device) - before


def profile_cuda_budget(config: EngineConfig, device: torch.device, max_model_len: int,
                        make_runner: Callable[[int], ModelRunner],
                        make_draft_runner: Callable[[int], ModelRunner] | None = None, cuda=torch.cuda) -> int:
    """KV budget on CUDA: gathers `DeviceMemory` (kv_budget.py does the arithmetic). The whole device's free memory
    and torch's share of what is taken; then, on runners holding just the blocks a probe needs, the peak of the
    worst step the scheduler can form (`worst_step_lengths`, sampled as WORST_SAMPLING), the decode graphs' pool
    (captured here and released; the engine captures them again over its KV cache) and the peak of a draft model's
    first pass over a step that size. `cuda`: torch.cuda, or a stand-in with its memory functions (tests)."""
    lengths = worst_step_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_model_len - 1)
    release(cuda)
    free, total = cuda.mem_get_info(device)
    held = cuda.memory_reserved(device)
    step, blocks = probe_step(lengths, config.block_size, WORST_SAMPLING)
    runner = make_runner(blocks)
    step_peak = peak_bytes(cuda, device, lambda: runner.execute(step))
    graph_pool = 0
    if captures_graphs(device, config.enforce_eager, runner.backend):
        before = cuda.mem_get_info(device)[0]
        runner.capture_graphs(config.max_num_seqs, -(-max_model_len // config.block_size))
        graph_pool = before - cuda.mem_get_info(device)[0]
    del runner
    release(cuda)
    draft_peak = 0
    if make_draft_runner is not None:
        step, blocks = probe_step(lengths, config.block_size, PLAIN_PASS)
        draft = make_draft_runner(blocks)
        draft_peak = peak_bytes(cuda, device, lambda: draft.forward(draft.prepare(step)[0]))
        del draft
        release(cuda)
    memory = DeviceMemory(total, free, held, step_peak, draft_peak, graph_pool)
    budget = kv_budget_bytes(memory, config.gpu_memory_utilization)
    logger.info("KV budget %.2f GiB: %s", budget / GiB, memory.describe(config.gpu_memory_utilization))
    return budget
