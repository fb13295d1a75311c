"""Per-request timestamps in, serving metrics out: one definition shared by every system.

Definitions (as vLLM's benchmark uses them): TTFT = first token - arrival (queueing included);
TPOT = (finished - first token) / (output tokens - 1), per request; ITL = gaps between consecutive
tokens of a request, pooled; E2E = finished - arrival. Throughput divides by the wall time of the
whole run (first arrival to last finish).
"""

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as a system served it; times in seconds on one clock (any origin)."""

    request_id: str
    num_prompt_tokens: int
    output_token_ids: list[int]
    arrival: float
    first_token: float
    finished: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token, when known
    num_cached_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.finished - self.first_token) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist() if len(self.token_times) > 1 else []


@dataclass
class LatencyStats:
    mean: float
    p50: float
    p90: float
    p99: float
    max: float | None = None  # None in reports written before it was recorded

    @classmethod
    def of(cls, values: list[float]) -> "LatencyStats | None":
        if not values:
            return None
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(float(np.mean(values)), p50, p90, p99, float(np.max(values)))


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so p50 of [1, 2] is 1.5."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class BatchCounters:
    """What a system's batches held, step by step; filled only where the system exposes it."""

    num_steps: int = 0
    busy_slot_steps: int = 0  # sum over steps of requests doing useful work
    idle_slot_steps: int = 0  # slots held by finished (or padded) members that still cost a place
    padding_tokens: int = 0  # prompt padding a padded batch computes (or would compute)
    num_prompt_tokens: int = 0  # prompt tokens actually computed (cached ones excluded)

    @property
    def mean_batch_size(self) -> float | None:
        return self.busy_slot_steps / self.num_steps if self.num_steps else None

    @property
    def idle_ratio(self) -> float | None:
        held = self.busy_slot_steps + self.idle_slot_steps
        return self.idle_slot_steps / held if held else None

    @property
    def padding_ratio(self) -> float | None:
        total = self.padding_tokens + self.num_prompt_tokens
        return self.padding_tokens / total if total else None


@dataclass
class RunMetrics:
    """The headline numbers of one system on one workload."""

    system: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    requests_s: float
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2e: LatencyStats | None
    mean_batch_size: float | None = None
    idle_ratio: float | None = None
    padding_ratio: float | None = None
    kv_usage_mean: float | None = None
    kv_usage_peak: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: int | None = None
    peak_rss_mb: float | None = None
    forward_fraction: float | None = None  # model forward (runner.execute) / step wall time
    num_steps: int | None = None  # kvloom engine steps that ran a batch (offline, or read from a server's /metrics)
    engine_busy_s: float | None = None  # seconds of the run the engine spent in those steps
    cpu_s: float | None = None  # process CPU time during the run: less sensitive to neighbours than wall time
    load_avg: float | None = None  # the machine's 1-minute load average at the end of the run
    spec_decode: dict | None = None  # speculative decoding's counters (vLLM's names), when it ran
    cpu_by_role: dict[str, float] | None = None  # `kvloom serve`: every process's CPU seconds in the run, by role
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> "RunMetrics":
        """Inverse of `dataclasses.asdict`, for results read back from JSON."""
        latency = {k: LatencyStats(**data[k]) if data[k] else None for k in ("ttft", "tpot", "itl", "e2e")}
        return cls(**{**data, **latency})


def acceptance(spec_decode: dict | None) -> tuple[float, float] | None:
    """(acceptance rate, mean accepted length: tokens a verifying step yields per request) of the counters."""
    if not spec_decode or not spec_decode.get("num_drafts"):
        return None
    return (spec_decode["num_accepted_tokens"] / spec_decode["num_draft_tokens"],
            1 + spec_decode["num_accepted_tokens"] / spec_decode["num_drafts"])


def summarize(system: str, records: list[RequestRecord], wall_s: float, batch: BatchCounters | None = None,
              **extra) -> RunMetrics:
    """Compute RunMetrics from per-request records; `extra` fills the system-specific fields."""
    prompt = sum(r.num_prompt_tokens for r in records)
    output = sum(r.num_output_tokens for r in records)
    batch = batch or BatchCounters()
    return RunMetrics(
        system=system,
        num_requests=len(records),
        prompt_tokens=prompt,
        output_tokens=output,
        wall_s=wall_s,
        output_tok_s=output / wall_s,
        total_tok_s=(prompt + output) / wall_s,
        requests_s=len(records) / wall_s,
        ttft=LatencyStats.of([r.ttft for r in records]),
        tpot=LatencyStats.of([t for r in records if (t := r.tpot) is not None]),
        itl=LatencyStats.of([g for r in records for g in r.itls]),
        e2e=LatencyStats.of([r.e2e for r in records]),
        mean_batch_size=batch.mean_batch_size,
        num_steps=batch.num_steps or None,
        idle_ratio=batch.idle_ratio,
        padding_ratio=batch.padding_ratio,
        **extra,
    )
