"""Colocated vs disaggregated serving, same machine, same workloads, through the real HTTP server.

Two colocated replicas against one prefill + one decode replica (both transports), on
`long-prefill` (a few long prompts among chats: what disaggregation is for) and `chat`. Reports
TTFT and TPOT p50/p99 and tok/s per setup. On a 2-core CPU both setups share the same two cores,
so this measures scheduling and hand-off overhead honestly, not the GPU win (see the report).

Run: `python -m kvloom.benchmarks.studies.disagg` (about 10 minutes on 2 cores); writes
`benchmarks/results/disagg.{md,json}`.
"""

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvloom.benchmarks.http_replay import replay_http
from kvloom.benchmarks.metrics import RunMetrics, summarize
from kvloom.benchmarks.workloads import default_corpus, make_workload
from kvloom.cluster.config import ClusterConfig

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
ENGINE = {"max_model_len": 4096, "max_num_seqs": 16, "kv_cache_memory_bytes": 512 << 20}
SETUPS = {
    "colocated 2x": {"num_replicas": 2},
    "1P+1D torch.distributed": {"disaggregation": {"enabled": True, "transport": "torch_distributed"}},
    "1P+1D object store": {"disaggregation": {"enabled": True, "transport": "object_store"}},
}
WORKLOADS = {
    "long-prefill": {"num_requests": 16, "num_long": 3, "rate": 0.5, "long_len": (1536, 2560), "long_output": 32,
                     "output_mean": 64},
    "chat": {"num_requests": 16, "rate": 0.5, "output_mean": 64, "prompt_mean": 200},
}


def run_all(base: str, port_setup) -> dict:
    corpus = default_corpus()
    results: dict = {}
    for setup, overrides in SETUPS.items():
        port_setup(ClusterConfig.model_validate({"engine": ENGINE, "resources": {"torch_threads": 1}, **overrides}))
        for name, params in WORKLOADS.items():
            workload = make_workload(name, corpus, seed=0, **params)
            asyncio.run(replay_http(base, workload.head(2)))  # warm-up: compile paths, fill nothing
            records, wall = asyncio.run(replay_http(base, workload))
            results.setdefault(name, {})[setup] = asdict(summarize(setup, records, wall))
            print(f"[disagg] {name:<13} {setup:<24} {results[name][setup]['output_tok_s']:.1f} out tok/s", flush=True)
    return results


def fmt_ms(stats: dict | None, key: str) -> str:
    return f"{stats[key] * 1000:.0f}" if stats else "-"


def write_report(results: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "disagg.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        "# Colocated vs disaggregated prefill/decode (CPU)", "",
        f"Machine: {meta['machine']}; model SmolLM2-135M fp32; one torch thread per replica; "
        f"regenerate with `python -m kvloom.benchmarks.studies.disagg` ({meta['wall_s']:.0f} s).", "",
    ]
    for name, by_setup in results.items():
        lines += [f"## {name} ({WORKLOADS[name]})", "",
                  "| setup | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        for setup, data in by_setup.items():
            m = RunMetrics.from_dict(data)
            ttft, tpot = data["ttft"], data["tpot"]
            lines.append(f"| {setup} | {m.output_tok_s:.1f} | {fmt_ms(ttft, 'p50')} | {fmt_ms(ttft, 'p99')} | "
                         f"{fmt_ms(tpot, 'p50')} | {fmt_ms(tpot, 'p99')} |")
        lines.append("")
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
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "wall_s": time.monotonic() - started}
    write_report(results, meta, args.out)
    print(f"[disagg] report: {args.out / 'disagg.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
