"""The CUDA KV budget's arithmetic, apart from the device: what `gpu_memory_utilization` of the whole device
leaves for the KV cache once everything else on it is counted.

`resources.profile_cuda_budget` gathers the figures (`DeviceMemory`) on the device before the KV cache exists;
`kv_budget_bytes` turns them into bytes. The utilization caps the device as a whole: other processes' memory,
this process's CUDA context, NCCL and library buffers count as used (they are what `cudaMemGetInfo` reports taken
beyond torch's own memory), so several engines sharing a device each need the utilization that leaves room for
the ones started before. A step's activations and a draft model's first pass
run one after the other, so the larger of their peaks is reserved; the decode graphs' pool is held for good.
"""

from dataclasses import dataclass

from kvloom.engine.errors import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes, measured on the device before the KV cache is allocated."""
    total: int  # the device's memory
    free: int  # free on the whole device when the profile starts (cudaMemGetInfo)
    held: int  # of what is taken then, this engine's tensors (torch's reserved memory): weights, adapter slots, a draft
    step_peak: int  # above those, a worst-case step's peak: a max-size forward and its sampling
    draft_peak: int = 0  # above them, a draft model's first pass over a max-size step (0: no draft model)
    graph_pool: int = 0  # the decode CUDA graphs' memory pool (0: no graphs)

    @property
    def others(self) -> int:
        """Taken but not torch's: other processes, this process's CUDA context, NCCL and library workspaces."""
        return self.total - self.free - self.held

    def describe(self, utilization: float) -> str:
        """The breakdown, in GiB, for a log line or an error."""
        draft = f", draft's first pass {self.draft_peak / GiB:.2f}" if self.draft_peak else ""
        return (f"{utilization:g} of {self.total / GiB:.2f} GiB = {self.total * utilization / GiB:.2f} GiB; "
                f"taken by other processes, CUDA context and NCCL {self.others / GiB:.2f}, weights and buffers "
                f"{self.held / GiB:.2f}, worst-case step (forward and sampling) {self.step_peak / GiB:.2f}{draft}, "
                f"CUDA graph pool {self.graph_pool / GiB:.2f}")


def kv_budget_bytes(memory: DeviceMemory, utilization: float) -> int:
    """The KV cache's bytes: `utilization` of the device less everything else that will be on it. Raises
    ConfigError (gpu_memory_utilization, with the breakdown) when nothing is left."""
    used = memory.total - memory.free + max(memory.step_peak, memory.draft_peak) + memory.graph_pool
    budget = int(memory.total * utilization) - used
    if budget <= 0:
        raise ConfigError("gpu_memory_utilization", f"leaves no room for the KV cache: {memory.describe(utilization)} "
                                                    f"({-budget / GiB:.2f} GiB short)")
    return budget


def worst_step_lengths(tokens: int, rows: int, longest: int) -> list[int]:
    """The new tokens of each request in the most demanding step the scheduler can form: `tokens` over as many
    of `rows` requests as they reach (each one sampled), the first ones prompt chunks of up to `longest` tokens
    (the longest prompt), the rest one token each."""
    lengths = [1] * min(rows, tokens)
    extra = tokens - len(lengths)
    for i in range(len(lengths)):
        grown = min(extra, longest - 1)
        lengths[i] += grown
        extra -= grown
    return lengths
