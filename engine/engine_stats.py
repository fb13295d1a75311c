"""An engine's counters, as `LLMEngine.stats()` reports them (replicas push them to the router)."""

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    peak_used_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    batch_slots: int  # requests computed, summed over steps
    step_seconds: float  # wall time in steps that ran a batch: over a span's wall time, how busy the engine was
    idle_slot_steps: int
    padding_tokens: int

    @property
    def mean_batch_size(self) -> float:
        return self.batch_slots / self.num_steps if self.num_steps else 0.0
