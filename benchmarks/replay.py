"""Replay a workload through one LLMEngine at its arrival times, as a server would see it.

Requests are added when their arrival time passes (stamped with the scheduled arrival, so time spent
waiting for a step to end counts as queueing), the engine steps while it has work, and the loop
sleeps until the next arrival when idle. Every step is timed, and so is the model forward inside it
(`runner.execute`), which is what separates engine overhead from model time.
"""

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvloom.benchmarks.strategies import STRATEGIES
from kvloom.benchmarks.metrics import BatchCounters, RequestRecord
from kvloom.benchmarks.workloads import Workload
from kvloom.engine.config import EngineConfig
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams


def strategy_config(strategy: str, workload: Workload, **settings) -> EngineConfig:
    """EngineConfig for `strategy` on `workload`; without chunking the token budget must hold any prompt."""
    overrides = {**STRATEGIES[strategy], **settings}
    longest = max(len(r.prompt) + r.max_tokens for r in workload.requests)
    overrides.setdefault("max_model_len", longest + 1)
    if not overrides["enable_chunked_prefill"]:
        overrides["max_num_batched_tokens"] = max(overrides.get("max_num_batched_tokens", 2048),
                                                  overrides["max_model_len"])
    return EngineConfig(**overrides)


@dataclass
class StepShape:
    """What one forward computed: enough to count its FLOPs exactly."""

    batch_size: int = 0  # requests in the forward
    num_tokens: int = 0  # new tokens (== batch_size for a decode-only step)
    context_tokens: int = 0  # sum over requests of the keys each new token's request attends to at the end


class ForwardTimer:
    """Times `runner.execute` (the model forward plus sampling) of one engine from the outside."""

    def __init__(self, engine: LLMEngine) -> None:
        self.last_s = 0.0
        self.last = StepShape()
        inner = engine.runner.execute

        def timed(scheduled, *args, **kwargs):
            shape = StepShape(len(scheduled), sum(n for _, n in scheduled),
                              sum(r.num_computed_tokens + n for r, n in scheduled))
            start = time.perf_counter()
            try:
                return inner(scheduled, *args, **kwargs)
            finally:
                self.last_s = time.perf_counter() - start
                self.last = shape

        engine.runner.execute = timed


@dataclass
class StepSample:
    t: float  # step end, seconds since the replay started
    batch_size: int
    num_tokens: int
    context_tokens: int
    step_s: float
    forward_s: float
    cpu_s: float  # process CPU time of the step (all threads): what it cost, whatever the neighbours did
    kv_usage: float


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    wall_s: float
    counters: BatchCounters
    steps: list[StepSample] = field(default_factory=list)
    prefix_hit_rate: float | None = None
    preemptions: int = 0
    kv_usage_peak: float = 0.0
    spec_decode: dict | None = None

    @property
    def kv_usage_mean(self) -> float:
        return sum(s.kv_usage for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def forward_fraction(self) -> float:
        total = sum(s.step_s for s in self.steps)
        return sum(s.forward_s for s in self.steps) / total if total else 0.0


def replay(engine: LLMEngine, workload: Workload,
           on_finish: Callable[[RequestRecord], None] | None = None) -> ReplayResult:
    """Drive `engine` through `workload` in real time; greedy, EOS ignored, outputs forced to max_tokens."""
    timer = ForwardTimer(engine)
    before = engine.stats()
    spec_before = copy.deepcopy(engine.spec_decode_stats)
    pending = sorted(workload.requests, key=lambda r: r.arrival_s, reverse=True)
    token_times: dict[str, list[float]] = {}
    records: list[RequestRecord] = []
    steps: list[StepSample] = []
    t0 = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic()
        while pending and t0 + pending[-1].arrival_s <= now:
            r = pending.pop()
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, detokenize=False)
            engine.add_request(r.request_id, r.prompt, params, priority=r.priority, arrival_time=t0 + r.arrival_s,
                               lora=r.lora)
            token_times[r.request_id] = []
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + pending[-1].arrival_s - time.monotonic()))
            continue
        timer.last_s = 0.0
        start, cpu = time.monotonic(), time.process_time()
        outputs = engine.step()
        end, cpu = time.monotonic(), time.process_time() - cpu
        if timer.last_s == 0.0:  # nothing scheduled (a batch waiting to fill): do not spin
            time.sleep(0.001)
            continue
        stats = engine.stats()
        shape = timer.last
        steps.append(StepSample(end - t0, shape.batch_size, shape.num_tokens, shape.context_tokens, end - start,
                                timer.last_s, cpu, 1 - stats.num_free_blocks / stats.num_blocks))
        for out in outputs:
            token_times[out.request_id].extend([end] * len(out.outputs[0].delta_token_ids))
            if out.finished:
                m = out.metrics
                record = RequestRecord(
                    out.request_id, len(out.prompt_token_ids), list(out.outputs[0].token_ids), m.arrival_time,
                    m.first_token_time, m.finished_time, m.first_scheduled_time, token_times.pop(out.request_id),
                    out.num_cached_tokens,
                )
                records.append(record)
                if on_finish:
                    on_finish(record)
    wall = time.monotonic() - t0
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    counters = BatchCounters(
        num_steps=after.num_steps - before.num_steps, busy_slot_steps=after.batch_slots - before.batch_slots,
        idle_slot_steps=after.idle_slot_steps - before.idle_slot_steps,
        padding_tokens=after.padding_tokens - before.padding_tokens,
        num_prompt_tokens=sum(r.num_prompt_tokens - r.num_cached_tokens for r in records),
    )
    return ReplayResult(
        records, wall, counters, steps,
        prefix_hit_rate=(after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else None,
        preemptions=after.num_preemptions - before.num_preemptions,
        kv_usage_peak=after.peak_used_blocks / after.num_blocks,
        spec_decode=asdict(engine.spec_decode_stats.since(spec_before)) if spec_before else None,
    )
