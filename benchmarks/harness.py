"""Run one system (a kvloom strategy or a peer) on one workload, each in its own fresh process.

A fresh process per system gives every system the same clean start (no allocator or thread-pool
state left by the previous one), makes its peak RSS its own, and lets a run that outlives its time
limit be stopped without losing what it finished: records are appended to disk as requests finish.
"""

import json
import multiprocessing
import os
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvloom.benchmarks.metrics import RequestRecord, RunMetrics, summarize
from kvloom.benchmarks.workloads import Workload

# The batching strategies under test: same runner and kernels, only the scheduling differs.


@dataclass(frozen=True)
class BenchSettings:
    """What every system shares, so that only the system differs between runs."""

    model: str = "smollm2"
    threads: int = 2
    max_num_seqs: int = 64  # kvloom max_num_seqs; hf-cb max_requests_per_batch
    max_num_batched_tokens: int = 2048  # kvloom token budget per step; hf-cb max_batch_tokens
    kv_cache_memory_bytes: int = 2 << 30  # kvloom KV budget; hf-cb gets as many pages of the same bytes
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # kvloom only: narrower halves the bytes decode attention streams
    timeout_s: float = 600.0
    hf_cb_attention: str = "sdpa"  # the fastest implementation transformers' CB accepts on CPU


@dataclass(frozen=True)
class SystemSpec:
    name: str  # as shown in tables: "continuous", "hf-static-16", ...
    kind: str  # "kvloom" | "hf-static" | "hf-cb"
    strategy: str = "continuous"  # kvloom only
    batch_size: int = 0  # hf-static only
    engine: dict = field(default_factory=dict)  # kvloom EngineConfig overrides
    num_requests: int | None = None  # run only the first N requests (a stated subset)
    serve: dict = field(default_factory=dict)  # kvloom-serve only: top-level config (tenants, admin keys)
    extra_args: tuple[str, ...] = ()  # vllm-serve only: more of its command-line flags


@dataclass
class SystemResult:
    spec: SystemSpec
    status: str  # "ok", "timeout", or "error: ..."
    metrics: RunMetrics | None
    requests: list[dict]  # per request: id, prompt, output, ttft, tpot, e2e (for CDFs)
    outputs: dict[str, list[int]]  # generated token ids, for the equality check
    elapsed_s: float  # including model load
    rss_after_load_mb: float | None = None
    steps: list[dict] = field(default_factory=list)  # kvloom: every step's shape and timings


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def request_rows(records: list[RequestRecord]) -> list[dict]:
    return [{"id": r.request_id, "prompt": r.num_prompt_tokens, "output": r.num_output_tokens,
             "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e} for r in records]


def _run_kvloom(spec: SystemSpec, workload: Workload, settings: BenchSettings, on_record):
    from kvloom.benchmarks.replay import replay, strategy_config
    from kvloom.engine.llm_engine import LLMEngine

    shared = {"model": settings.model, "device": "cpu", "max_num_seqs": settings.max_num_seqs,
              "max_num_batched_tokens": settings.max_num_batched_tokens,
              "kv_cache_memory_bytes": settings.kv_cache_memory_bytes,
              "enable_prefix_caching": settings.enable_prefix_caching, "kv_cache_dtype": settings.kv_cache_dtype}
    engine = LLMEngine(strategy_config(spec.strategy, workload, **{**shared, **spec.engine}))
    engine.warm_up()
    loaded = _peak_rss_mb()
    cpu = time.process_time()
    result = replay(engine, workload, on_record)
    metrics = summarize(
        spec.name, result.records, result.wall_s, result.counters, kv_usage_mean=result.kv_usage_mean,
        kv_usage_peak=result.kv_usage_peak, prefix_hit_rate=result.prefix_hit_rate,
        preemptions=result.preemptions, forward_fraction=result.forward_fraction, cpu_s=time.process_time() - cpu,
        engine_busy_s=sum(step.step_s for step in result.steps),
        spec_decode=result.spec_decode,
    )
    return result.records, metrics, loaded, [asdict(s) for s in result.steps]


def _run_peer(spec: SystemSpec, workload: Workload, settings: BenchSettings, on_record):
    from kvloom.benchmarks.peers import HFContinuousPeer, HFStaticPeer, load_hf_model

    if spec.kind == "hf-static":
        peer = HFStaticPeer(load_hf_model(settings.model, "sdpa"), spec.batch_size)
        # First-call costs are not the system's; a short request pays them (a whole W1 request took ~15 s).
        first = workload.requests[0]
        peer.run(Workload("warmup", [replace(first, prompt=first.prompt[:32], max_tokens=2)]))
    else:
        peer = HFContinuousPeer(load_hf_model(settings.model, settings.hf_cb_attention),
                                settings.kv_cache_memory_bytes, settings.max_num_batched_tokens,
                                settings.max_num_seqs)
    loaded = _peak_rss_mb()
    cpu = time.process_time()
    records, counters, wall = peer.run(workload, on_record)
    return records, summarize(spec.name, records, wall, counters, cpu_s=time.process_time() - cpu), loaded, []


def _child(spec: SystemSpec, workload_path: str, settings: BenchSettings, out_dir: str) -> None:
    """Entry point of the per-system process: results go to files in `out_dir`."""
    from tqdm import tqdm

    from kvloom.kernels.item_pool import set_intra_op_threads

    set_intra_op_threads(settings.threads)
    workload = Workload.load(Path(workload_path)).with_token_ids(settings.model)
    if spec.num_requests is not None:
        workload = workload.head(spec.num_requests)
    out = Path(out_dir)
    bar = tqdm(total=len(workload.requests), desc=f"  {spec.name}", unit="req", position=1, leave=False)
    with (out / "records.jsonl").open("w") as sink:
        def on_record(record: RequestRecord) -> None:
            sink.write(json.dumps(asdict(record)) + "\n")
            sink.flush()
            bar.update(1)

        run = _run_kvloom if spec.kind == "kvloom" else _run_peer
        records, metrics, loaded, steps = run(spec, workload, settings, on_record)
    bar.close()
    metrics.peak_rss_mb = _peak_rss_mb()
    metrics.load_avg = os.getloadavg()[0]
    order = {r.request_id: i for i, r in enumerate(workload.requests)}
    records.sort(key=lambda r: order[r.request_id])
    if spec.num_requests is not None:
        metrics.notes.append(f"stated subset: first {spec.num_requests} requests of the workload")
    (out / "result.json").write_text(json.dumps({
        "metrics": asdict(metrics), "requests": request_rows(records),
        "outputs": {r.request_id: r.output_token_ids for r in records}, "rss_after_load_mb": loaded,
        "steps": steps,
    }))


def _partial(spec: SystemSpec, out: Path, timeout_s: float) -> tuple[RunMetrics | None, list[RequestRecord]]:
    """What a stopped run finished, measured over the span of its finished requests (flagged)."""
    path = out / "records.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = [RequestRecord(**json.loads(line)) for line in lines if line]
    if not records:
        return None, []
    span = max(r.finished for r in records) - min(r.arrival for r in records)
    metrics = summarize(spec.name, records, span)
    metrics.notes.append(f"stopped at its {timeout_s:.0f} s limit: numbers cover the {len(records)} requests "
                         "that finished (biased toward short ones)")
    return metrics, records


def run_isolated(spec: SystemSpec, workload_path: Path, settings: BenchSettings, out_dir: Path,
                 limit_s: float | None = None) -> SystemResult:
    """Run `spec` in a fresh spawned process, stopping it at `limit_s` (default `settings.timeout_s`)."""
    limit_s = limit_s or settings.timeout_s
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("records.jsonl", "result.json"):
        (out_dir / stale).unlink(missing_ok=True)
    process = multiprocessing.get_context("spawn").Process(
        target=_child, args=(spec, str(workload_path), settings, str(out_dir)), name=f"bench-{spec.name}")
    start = time.monotonic()
    process.start()
    process.join(limit_s)
    status = "ok"
    if process.is_alive():
        process.terminate()
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
        status = "timeout"
    elapsed = time.monotonic() - start
    result_file = out_dir / "result.json"
    if status == "ok" and result_file.exists():
        data = json.loads(result_file.read_text())
        metrics = RunMetrics.from_dict(data["metrics"])
        return SystemResult(spec, status, metrics, data["requests"], data["outputs"], elapsed,
                            data["rss_after_load_mb"], data["steps"])
    if status == "ok":
        status = f"error: exit code {process.exitcode} (see the log above)"
    metrics, records = _partial(spec, out_dir, limit_s)
    return SystemResult(spec, status, metrics, request_rows(records),
                        {r.request_id: r.output_token_ids for r in records}, elapsed)
