"""An engine's counters, as `LLMEngine.stats()` reports them, and `EngineReport`, what a replica tells the router
about its engine (counters and the facts that do not change)."""

from dataclasses import dataclass, field

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.scheduler import Scheduler


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
    # per tier: hits, misses, blocks written, bytes read, load seconds, bytes used; and the engine's restore seconds,
    # loads in flight and pool blocks they hold
    kv_tiers: dict | None = None

    @property
    def mean_batch_size(self) -> float:
        return self.batch_slots / self.num_steps if self.num_steps else 0.0

    @classmethod
    def collect(cls, scheduler: Scheduler, kv: KVCacheManager, step_seconds: float) -> "EngineStats":
        pool, counters = kv.pool, scheduler.counters
        return cls(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting) + len(scheduler.loading), num_free_blocks=pool.num_free,
            num_blocks=pool.num_blocks, peak_used_blocks=pool.peak_num_used, kv_cache_usage=pool.usage,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            num_preemptions=scheduler.num_preemptions, num_steps=counters.num_steps, batch_slots=counters.batch_slots,
            step_seconds=step_seconds, idle_slot_steps=counters.idle_slot_steps,
            padding_tokens=scheduler.batching.padding_tokens,
            kv_tiers=kv.tiers.as_dict() | kv.tier_io.as_dict() if kv.tiers is not None else None,
        )


@dataclass
class EngineReport:
    """`AsyncLLMEngine.report()`: the engine's facts and counters, read where a replica needs them."""

    stats: EngineStats
    device: str
    dtype: str
    block_size: int
    max_model_len: int
    spec_decode: dict | None  # SpecDecodeStats as a dict; None without speculation
    recent_prefix_hashes: list[int]
    recent_tier_hashes: list[int]  # of blocks the node's KV tiers hold, as the engine lately saw them there
    ranks: list = field(default_factory=list)  # tensor-parallel RankReports; empty on one rank
    startup: dict[str, float] = field(default_factory=dict)  # start-up phase -> seconds (StartupTimes)
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters in host memory
