"""Colocated vs disaggregated serving, same machine, same workloads, through the real HTTP server.

Two colocated replicas against one prefill + one decode replica (both transports), on W1 (64 requests at once:
the hand-off protocol under load), `long-prefill` (a few long prompts among chats: what disaggregation is for)
and `chat`. Reports TTFT and TPOT p50/p99 and tok/s per setup, and what a hand-off costs (the decode replicas'
own counts: KV bytes, seconds from blocks reserved to KV in hand, hand-offs computed locally instead). On a
2-core CPU both setups share the same two cores, so this measures scheduling and hand-off overhead honestly,
not the GPU win (see the report).

Run: `python -m kvloom.benchmarks.studies.disagg` (about 15 minutes on 2 cores); writes
`benchmarks/results/disagg.{md,json}`.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.http_replay import replay_http
from kvloom.benchmarks.metrics import RunMetrics, summarize
from kvloom.benchmarks.workloads import default_corpus, make_workload
from kvloom.cluster.config import ClusterConfig
from kvloom.kernels.host_isa import host_isa

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
ENGINE = {"max_model_len": 4096, "max_num_seqs": 16, "kv_cache_memory_bytes": 512 << 20}
SETUPS = {
    "colocated 2x": {"num_replicas": 2},
    "1P+1D torch.distributed": {"disaggregation": {"enabled": True, "transport": "torch_distributed"}},
    "1P+1D object store": {"disaggregation": {"enabled": True, "transport": "object_store"}},
}
WORKLOADS = {
    "offline-mixed": {"num_requests": 64},
    "long-prefill": {"num_requests": 16, "num_long": 3, "rate": 0.5, "long_len": (1536, 2560), "long_output": 32,
                     "output_mean": 64},
    "chat": {"num_requests": 16, "rate": 0.5, "output_mean": 64, "prompt_mean": 200},
}


GOAL_RATIO = 0.8  # disaggregated W1 throughput against the same two replicas colocated


def handoff_counts(router) -> dict[str, float]:
    """The decode replicas' hand-off counters, summed."""
    totals: dict[str, float] = {}
    for stats in router.replica_stats.remote().result():
        for key, value in (stats.get("handoffs") or {}).items():
            totals[key] = totals.get(key, 0) + value
    return totals


def run_all(base: str, port_setup) -> dict:
    corpus = default_corpus()
    results: dict = {}
    for setup, overrides in SETUPS.items():
        router = port_setup(ClusterConfig.model_validate({"engine": ENGINE, "resources": {"torch_threads": 1},
                                                          **overrides}))
        for name, params in WORKLOADS.items():
            workload = make_workload(name, corpus, seed=0, **params)
            asyncio.run(replay_http(base, workload.head(2)))  # warm-up: compile paths, fill nothing
            before = handoff_counts(router)
            records, wall = asyncio.run(replay_http(base, workload))
            after = handoff_counts(router)
            results.setdefault(name, {})[setup] = {
                **asdict(summarize(setup, records, wall)), "handoffs": {k: v - before.get(k, 0) for k, v in after.items()}}
            print(f"[disagg] {name:<13} {setup:<24} {results[name][setup]['output_tok_s']:.1f} out tok/s", flush=True)
    return results


def goal_line(results: dict) -> str:
    w1 = results["offline-mixed"]
    base, split = w1["colocated 2x"], w1["1P+1D torch.distributed"]
    ratio = split["output_tok_s"] / base["output_tok_s"]
    return (f"| W1, 64 at once: 1P+1D torch.distributed vs colocated 2x, out tok/s | >= {GOAL_RATIO}x | "
            f"{ratio:.2f}x ({split['output_tok_s']:.1f} vs {base['output_tok_s']:.1f}) | "
            f"{'yes' if ratio >= GOAL_RATIO else '**no**'} |")


def handoff_rows(results: dict) -> list[str]:
    rows = []
    for name, by_setup in results.items():
        for setup, data in by_setup.items():
            counts = data["handoffs"]
            received = counts.get("received", 0)
            if not received and not counts.get("computed_here"):
                continue
            rows.append(f"| {name} | {setup} | {received:.0f} | {counts.get('computed_here', 0):.0f} | "
                        f"{counts['bytes'] / max(received, 1) / 2**20:.2f} | "
                        f"{counts['transfer_s'] / max(received, 1) * 1000:.1f} |")
    return rows


def fmt_ms(stats: dict | None, key: str) -> str:
    return f"{stats[key] * 1000:.0f}" if stats else "-"


def write_report(results: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "disagg.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        "# Colocated vs disaggregated prefill/decode (CPU)", "",
        "Every request of every run was served (the replay fails on any error).", "",
        f"kvloom `{meta['commit']}` on {meta['machine']}; model SmolLM2-135M fp32; one torch thread per replica; "
        f"regenerate with `python -m kvloom.benchmarks.studies.disagg` ({meta['wall_s']:.0f} s).", "",
        "| goal | target | measured | met |", "|---|---|---|---|", goal_line(results), "",
    ]
    for name, by_setup in results.items():
        lines += [f"## {name} ({WORKLOADS[name]})", "",
                  "| setup | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        for setup, data in by_setup.items():
            m = RunMetrics.from_dict({k: v for k, v in data.items() if k != "handoffs"})
            ttft, tpot = data["ttft"], data["tpot"]
            lines.append(f"| {setup} | {m.output_tok_s:.1f} | {fmt_ms(ttft, 'p50')} | {fmt_ms(ttft, 'p99')} | "
                         f"{fmt_ms(tpot, 'p50')} | {fmt_ms(tpot, 'p99')} |")
        lines.append("")
    lines += ["## What a hand-off costs", "",
              "The decode replicas' counts: KV received per hand-off, and the time from its blocks reserved to "
              "its KV in hand (the prefill side's export, waiting for its engine's step, and the transfer).", "",
              "| workload | setup | received | computed locally | MiB each | ms each |", "|---|---|---:|---:|---:|---:|",
              *handoff_rows(results), ""]
    lines += [
        "## Reading it", "",
        "On this machine all replicas share two CPU cores, so a prefill replica and a decode replica "
        "compete for the same cores that two colocated replicas use: disaggregation cannot add compute "
        "here, and the hand-off (export, transfer over gloo on loopback or the object store, import) is "
        "overhead. With one prefill replica every prompt queues on one engine, while two colocated "
        "replicas split the prompts between them, so expect TTFT to rise under 1P+1D whenever prompts "
        "are long; the decode replica, which never runs a prefill, is where TPOT can improve. The object "
        "store path copies the KV through plasma twice and is the slowest; gloo sends it point to point. "
        "Timings come from a shared, noisy machine: compare rows of one run only.",
        "",
        "On GPUs with NCCL the picture changes: prefill (compute-bound) and decode (memory-bound) get "
        "separate devices sized for each, the KV moves over NVLink/InfiniBand at tens to hundreds of GB/s "
        "(a 2k-token SmolLM2 prompt is ~90 MB of fp32 KV, ~45 MB in bf16: well under a millisecond on "
        "NVLink), and decode batches stay large and steady because no prefill ever joins them, which is "
        "where DistServe and Splitwise report their TTFT/TPOT wins.",
    ]
    (out / "disagg.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.studies.disagg", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    from kvloom.benchmarks.local_serve import local_serve
    from kvloom.cluster.app import deploy

    started = time.monotonic()
    with local_serve() as base:
        results = run_all(base, deploy)
    meta = {"machine": f"{host_isa().describe()}, {os.cpu_count()} cores", "commit": source_commit(),
            "wall_s": time.monotonic() - started}
    write_report(results, meta, args.out)
    print(f"[disagg] report: {args.out / 'disagg.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
