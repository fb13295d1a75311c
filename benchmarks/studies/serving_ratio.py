"""`kvloom serve` against its own offline engine on W1, in alternated rounds: what the serving path costs.

Issue 17 asks `kvloom serve` for at least 0.9x of the offline throughput on W1. That is a ratio of two runs on
hosts whose speed drifts 10-30% within minutes, so one run of each decides little. Here, in each round, three
runs follow one another, each in fresh processes: the offline engine with the settings `kvloom serve` ships
(chunked prefill on; the benchmark's shared settings); `kvloom serve` with the workload sent straight to its
engine replica (benchmarks/studies/replica_replay.py: the engine as Serve hosts it, beside Ray's processes, with no
router, HTTP or client); and `kvloom serve` over streaming HTTP, what a user gets. The first step down is what
hosting the engine in Ray Serve costs, the second what the HTTP path costs. The report gives every round's
ratios and their medians, each run's engine steps and time a step, and whose CPU each served run used.

    python -m kvloom.benchmarks.studies.serving_ratio [--rounds 3] [--out DIR]     (~3 minutes a round)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from kvloom.benchmarks.external_peers import Server, ServerUnavailable, run_external, run_served
from kvloom.benchmarks.harness import BenchSettings, SystemResult, SystemSpec, run_isolated
from kvloom.benchmarks.metrics import RequestRecord
from kvloom.benchmarks.process_tree import wait_for
from kvloom.benchmarks.studies.replica_replay import cluster_address
from kvloom.benchmarks.serving_cpu import beside_engine, serving_cpu_line
from kvloom.benchmarks.workloads import Workload, default_corpus, make_workload
from kvloom.kernels.host_isa import host_isa

GOAL = 0.9
OFFLINE = SystemSpec("continuous+chunked", "kvloom", strategy="continuous+chunked")  # kvloom serve's engine
REPLICA = SystemSpec("kvloom-serve, straight to the replica", "kvloom-serve")
SERVED = SystemSpec("kvloom-serve", "kvloom-serve")
RUNS = ("offline", "replica", "served")
DRIVER = "driver (the benchmark, a Serve handle)"


def _summary(result) -> dict | None:
    m = result.metrics
    if result.status != "ok" or m is None:
        return None
    steps = m.num_steps or 0
    return {"output_tok_s": m.output_tok_s, "wall_s": m.wall_s, "steps": steps,
            "step_ms": 1000 * m.engine_busy_s / steps if steps and m.engine_busy_s else None,
            "cpu_by_role": m.cpu_by_role}


def run_replica(workload_path: Path, settings: BenchSettings, out_dir: Path) -> SystemResult:
    """`kvloom serve` started as for the HTTP run, the workload sent by replica_replay's driver (a process of its
    own, whose CPU counts as the client's does)."""
    workload = Workload.load(workload_path).with_token_ids(settings.model)
    driven = workload.save(out_dir / "workload.jsonl")
    records_path = out_dir / "records.json"

    def straight_to_the_replica(server: Server, left_s: float) -> tuple[list[RequestRecord], float, float]:
        address = _printed_address(out_dir / "log.txt")
        try:
            with (out_dir / "driver.txt").open("w") as driver_log:
                subprocess.run([sys.executable, "-m", "kvloom.benchmarks.studies.replica_replay", "--address", address,
                                "--workload", str(driven), "--out", str(records_path)],
                               stdout=driver_log, stderr=subprocess.STDOUT, check=True, timeout=left_s)
        except subprocess.SubprocessError as exc:
            raise ServerUnavailable(f"error: the driver failed ({exc}; see {out_dir / 'driver.txt'})") from exc
        done = json.loads(records_path.read_text())
        return [RequestRecord(**r) for r in done["records"]], done["wall_s"], done["driver_cpu_s"]

    return run_served(REPLICA, workload, settings, out_dir, settings.timeout_s, straight_to_the_replica, DRIVER)


def _printed_address(log_path: Path, timeout_s: float = 120) -> str:
    """The cluster's address, once `kvloom serve` has printed it (after its replicas reported)."""
    def address() -> str | None:
        return cluster_address(log_path.read_text(errors="replace"))

    if not wait_for(address, timeout_s):
        raise ServerUnavailable(f"error: `kvloom serve` printed no cluster address (see {log_path})")
    return address()


def run_rounds(rounds: int, settings: BenchSettings, out_dir: Path) -> list[dict]:
    """Offline, straight to the replica, over HTTP, `rounds` times; a run that failed is None in its round. Logs
    go under out_dir/runs."""
    workload = make_workload("offline-mixed", default_corpus(settings.model), seed=0)
    path = workload.save(out_dir / "runs" / f"{workload.name}.jsonl")
    rows = []
    for i in range(rounds):
        runs = out_dir / "runs" / f"round-{i}"
        results = {"offline": run_isolated(OFFLINE, path, settings, runs / "offline"),
                   "replica": run_replica(path, settings, runs / "replica"),
                   "served": run_external(SERVED, path, settings, runs / "served", settings.timeout_s)}
        rows.append({name: _summary(result) for name, result in results.items()})
        print(f"round {i}: " + ", ".join(f"{name} {result.status}" for name, result in results.items())
              + f"; over offline: {_ratio_text(ratio(rows[-1], 'replica'))} straight to the replica, "
              f"{_ratio_text(ratio(rows[-1], 'served'))} over HTTP", flush=True)
    return rows


def ratio(row: dict, run: str) -> float | None:
    """The run's output tok/s over the offline run's in the same round; None where either failed."""
    if not row["offline"] or not row.get(run):
        return None
    return row[run]["output_tok_s"] / row["offline"]["output_tok_s"]


def median_ratio(rows: list[dict], run: str = "served") -> float | None:
    ratios = [r for row in rows if (r := ratio(row, run)) is not None]
    return statistics.median(ratios) if ratios else None


def _ratio_text(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def report(rows: list[dict], describe_cpu: str, settings: BenchSettings) -> str:
    lines = [
        "# `kvloom serve` against its offline engine on W1, alternated rounds",
        "",
        f"Host: {describe_cpu}, {os.cpu_count()} CPUs; {settings.threads} engine threads, dtype auto. Each round, "
        f"each run in fresh processes: the offline `LLMEngine` with `kvloom serve`'s engine settings ({OFFLINE.name}); "
        "`kvloom serve` (shipped config) with the 64 requests sent straight to its engine replica through a Serve "
        "handle (no router, HTTP or client); `kvloom serve` over streaming HTTP, 64 concurrent requests. Regenerate: "
        "`python -m kvloom.benchmarks.studies.serving_ratio`.",
        "",
        "| round | offline out tok/s | steps, ms a step | straight to the replica | steps, ms a step | over HTTP "
        "| steps, ms a step | replica / offline | HTTP / offline | CPU s beside the engine, HTTP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def run_cells(run: dict | None) -> str:
        if run is None:
            return "failed | –"
        step = f"{run['step_ms']:.1f}" if run["step_ms"] else "–"
        return f"{run['output_tok_s']:.1f} | {run['steps']}, {step}"

    for i, row in enumerate(rows):
        served = row["served"]
        beside = f"{beside_engine(served['cpu_by_role']):.2f}" if served and served["cpu_by_role"] else "–"
        lines.append(f"| {i} | {' | '.join(run_cells(row.get(run)) for run in RUNS)} | "
                     f"{_ratio_text(ratio(row, 'replica'))} | {_ratio_text(ratio(row, 'served'))} | {beside} |")
    median = median_ratio(rows)
    verdict = "not measured" if median is None else ("met" if median >= GOAL else f"missed by {1 - median / GOAL:.0%}")
    lines += ["", f"Median over HTTP / offline: **{_ratio_text(median)}** (goal >= {GOAL}: **{verdict}**); "
                  f"straight to the replica / offline: {_ratio_text(median_ratio(rows, 'replica'))}.", ""]
    lines += [f"- round {i}, {name}: {serving_cpu_line(row[run]['cpu_by_role'])}" for i, row in enumerate(rows)
              for run, name in (("replica", "straight to the replica"), ("served", "over HTTP"))
              if row.get(run) and row[run]["cpu_by_role"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "serving-ratio")
    args = parser.parse_args()
    settings = BenchSettings()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_rounds(args.rounds, settings, args.out)
    text = report(rows, host_isa().describe(), settings)
    (args.out / "serving-ratio.json").write_text(json.dumps({"settings": asdict(settings), "rounds": rows}, indent=1))
    (args.out / "serving-ratio.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
