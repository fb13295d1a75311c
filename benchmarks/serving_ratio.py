"""`kvloom serve` against its own offline engine on W1, in alternated pairs: what the serving path costs.

Issue 17 asks `kvloom serve` for at least 0.9x of the offline throughput on W1. That is a ratio of two runs on
hosts whose speed drifts 10-30% within minutes, so one run of each decides little. Here the offline engine with
the settings `kvloom serve` ships (chunked prefill on; the benchmark's shared settings) and `kvloom serve` over
streaming HTTP run one after the other, `--pairs` times, each in fresh processes; the report gives every pair's
ratio and their median, each run's engine steps and time a step, and whose CPU each served run used.

    python -m kvloom.benchmarks.serving_ratio [--pairs 3] [--out DIR]     (~2 minutes a pair)
"""

import argparse
import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path

from kvloom.benchmarks.external_peers import run_external
from kvloom.benchmarks.harness import BenchSettings, SystemSpec, run_isolated
from kvloom.benchmarks.serving_cpu import beside_engine, serving_cpu_line
from kvloom.benchmarks.workloads import default_corpus, make_workload
from kvloom.kernels.host_isa import host_isa

GOAL = 0.9
OFFLINE = SystemSpec("continuous+chunked", "kvloom", strategy="continuous+chunked")  # kvloom serve's engine
SERVED = SystemSpec("kvloom-serve", "kvloom-serve")


def _summary(result) -> dict | None:
    m = result.metrics
    if result.status != "ok" or m is None:
        return None
    steps = m.num_steps or 0
    return {"output_tok_s": m.output_tok_s, "wall_s": m.wall_s, "steps": steps,
            "step_ms": 1000 * m.engine_busy_s / steps if steps and m.engine_busy_s else None,
            "cpu_by_role": m.cpu_by_role}


def run_pairs(pairs: int, settings: BenchSettings, out_dir: Path) -> list[dict]:
    """Offline, then served, `pairs` times; a run that failed is None in its pair. Logs go under out_dir/runs."""
    workload = make_workload("offline-mixed", default_corpus(settings.model), seed=0)
    path = workload.save(out_dir / "runs" / f"{workload.name}.jsonl")
    rows = []
    for i in range(pairs):
        offline = run_isolated(OFFLINE, path, settings, out_dir / "runs" / f"pair-{i}" / "offline")
        served = run_external(SERVED, path, settings, out_dir / "runs" / f"pair-{i}" / "served", settings.timeout_s)
        rows.append({"offline": _summary(offline), "served": _summary(served)})
        ratio = pair_ratio(rows[-1])
        print(f"pair {i}: offline {offline.status}, served {served.status}, served / offline "
              f"{'–' if ratio is None else f'{ratio:.3f}'}", flush=True)
    return rows


def pair_ratio(row: dict) -> float | None:
    """Served over offline output tok/s; None where either run failed."""
    if not row["offline"] or not row["served"]:
        return None
    return row["served"]["output_tok_s"] / row["offline"]["output_tok_s"]


def median_ratio(rows: list[dict]) -> float | None:
    ratios = [ratio for row in rows if (ratio := pair_ratio(row)) is not None]
    return statistics.median(ratios) if ratios else None


def report(rows: list[dict], describe_cpu: str, settings: BenchSettings) -> str:
    lines = [
        "# `kvloom serve` against its offline engine on W1, alternated pairs",
        "",
        f"Host: {describe_cpu}, {os.cpu_count()} CPUs; {settings.threads} engine threads, dtype auto. Each pair: the "
        f"offline `LLMEngine` with `kvloom serve`'s engine settings ({OFFLINE.name}), then `kvloom serve` (shipped "
        "config) over streaming HTTP, 64 concurrent requests, each in fresh processes. Regenerate: "
        "`python -m kvloom.benchmarks.serving_ratio`.",
        "",
        "| pair | offline out tok/s | steps, ms a step | served out tok/s | steps, ms a step | served / offline "
        "| CPU s beside the engine |",
        "|---|---|---|---|---|---|---|",
    ]

    def run_cells(run: dict | None) -> str:
        if run is None:
            return "failed | –"
        step = f"{run['step_ms']:.1f}" if run["step_ms"] else "–"
        return f"{run['output_tok_s']:.1f} | {run['steps']}, {step}"

    for i, row in enumerate(rows):
        offline, served = row["offline"], row["served"]
        ratio = f"{r:.3f}" if (r := pair_ratio(row)) is not None else "–"
        beside = f"{beside_engine(served['cpu_by_role']):.2f}" if served and served["cpu_by_role"] else "–"
        lines.append(f"| {i} | {run_cells(offline)} | {run_cells(served)} | {ratio} | {beside} |")
    median = median_ratio(rows)
    verdict = "not measured" if median is None else ("met" if median >= GOAL else f"missed by {1 - median / GOAL:.0%}")
    lines += ["", f"Median served / offline: **{'–' if median is None else f'{median:.3f}'}** "
                  f"(goal >= {GOAL}: **{verdict}**).", ""]
    lines += [f"- pair {i}, served: {serving_cpu_line(row['served']['cpu_by_role'])}"
              for i, row in enumerate(rows) if row["served"] and row["served"]["cpu_by_role"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "serving-ratio")
    args = parser.parse_args()
    settings = BenchSettings()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_pairs(args.pairs, settings, args.out)
    text = report(rows, host_isa().describe(), settings)
    (args.out / "serving-ratio.json").write_text(json.dumps({"settings": asdict(settings), "pairs": rows}, indent=1))
    (args.out / "serving-ratio.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
