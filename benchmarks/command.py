"""What `kvloom bench` does, from parsed options to the written JSON, markdown and PNGs."""

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvloom.benchmarks.bench import (DEFAULT_HF_BATCHES, DEFAULT_PEERS, DEFAULT_STRATEGIES, REFERENCE,
                                     environment, in_fresh_process, make_systems, run_systems)
from kvloom.benchmarks.harness import BenchSettings
from kvloom.benchmarks.report import write_bench_report
from kvloom.benchmarks.run_results import system_result
from kvloom.benchmarks.roofline import engine_probes, machine_report
from kvloom.benchmarks.sweep import parse_sweep, summarize_sweep, sweep_systems
from kvloom.benchmarks.workloads import default_corpus, make_workload

OUT_ROOT = Path(__file__).resolve().parent / "out"


@dataclass
class BenchOptions:
    workload: str = "offline-mixed"
    seed: int = 0
    num_requests: int | None = None
    rates: list[float] = field(default_factory=list)  # one run per rate (workloads with arrivals)
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    peers: list[str] = field(default_factory=lambda: list(DEFAULT_PEERS))
    hf_batch_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_HF_BATCHES))
    hf_static_batches: int | None = None
    peer_requests: int | None = None
    sweep: str | None = None  # "max_num_seqs=1,4,16,64,256"
    speculative_config: dict | None = None  # for every kvloom engine and vLLM offline
    tpot_budget_ms: float = 250.0
    roofline: bool = True
    budget_s: float | None = None  # for each run (each rate): systems past their share are stopped, flagged
    out: Path | None = None
    settings: BenchSettings = field(default_factory=BenchSettings)


def machine_section(run: dict, run_dir: Path, system: str, settings: BenchSettings) -> dict:
    """GEMM ceilings and roofline for `run`'s workload, plus decode probes from `system`'s steps."""
    start = time.monotonic()
    machine = in_fresh_process(machine_report, settings.model, str(run_dir / f"{run['workload']}.jsonl"),
                               settings.threads)
    machine["elapsed_s"] = time.monotonic() - start
    result = system_result(run, system)
    machine["probes"] = engine_probes(machine, result["steps"] if result else [], settings.threads)
    return machine


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_")


def run_bench(options: BenchOptions) -> Path:
    """Run the benchmark `options` describe; returns the markdown report's path."""
    settings = options.settings
    out = options.out or OUT_ROOT / _slug(options.workload)
    corpus = default_corpus(settings.model)
    sweep = parse_sweep(options.sweep) if options.sweep else None
    strategy = REFERENCE if REFERENCE in options.strategies or not options.strategies else options.strategies[0]
    runs = []
    for rate in options.rates or [None]:
        params = {k: v for k, v in (("num_requests", options.num_requests), ("rate", rate)) if v is not None}
        workload = make_workload(options.workload, corpus, options.seed, **params)
        label = options.workload + (f" @ {rate:g} req/s" if rate is not None else "")
        systems = (sweep_systems(*sweep, strategy) if sweep else
                   make_systems(options.strategies, options.peers, options.hf_batch_sizes, options.hf_static_batches,
                                options.peer_requests, options.speculative_config))
        runs.append(run_systems(workload, systems, settings, out / _slug(label), label, options.budget_s))
    doc = {"title": runs[0]["label"] if len(runs) == 1 else options.workload,
           "environment": environment(settings), "runs": runs, "roofline_system": strategy}
    if options.roofline and not sweep:
        doc["machine"] = machine_section(runs[0], out / _slug(runs[0]["label"]), strategy, settings)
    if sweep:
        doc["sweep"] = summarize_sweep(runs[0], *sweep, options.tpot_budget_ms / 1000)
    return write_bench_report(doc, out)
