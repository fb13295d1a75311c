"""`kvloom bench` on the command line: its options, and running them (the one module `kvloom`'s CLI imports)."""

import argparse
import json
from pathlib import Path

from kvloom.benchmarks.bench import DEFAULT_HF_BATCHES, DEFAULT_PEERS, DEFAULT_STRATEGIES
from kvloom.benchmarks.workloads import GENERATORS

MULTI_TENANT = "multi-tenant"


def _csv(cast):
    return lambda text: [cast(v) for v in text.split(",") if v]


def run_bench_command(args: argparse.Namespace) -> int:
    if args.workload == MULTI_TENANT:  # the fairness benchmark: its own cluster, phases and report
        from kvloom.benchmarks.fairness import main as fairness

        return fairness(["--out", args.out] if args.out else [])
    from kvloom.benchmarks.command import BenchOptions, run_bench
    from kvloom.benchmarks.harness import BenchSettings

    settings = BenchSettings(
        model=args.model, threads=args.threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
        timeout_s=args.timeout_s,
    )
    if args.suite:
        from kvloom.benchmarks.suite import run_suite

        path = run_suite(settings, Path(args.out) if args.out else None)
    else:
        path = run_bench(BenchOptions(
            workload=args.workload, seed=args.seed, num_requests=args.num_requests, rates=args.rates,
            strategies=args.strategies, peers=args.peers, hf_batch_sizes=args.hf_batch_sizes,
            hf_static_batches=args.hf_static_batches or None, peer_requests=args.peer_requests or None,
            sweep=args.sweep, tpot_budget_ms=args.tpot_budget_ms, roofline=not args.no_roofline,
            speculative_config=args.speculative_config,
            budget_s=args.budget_min * 60 or None, out=Path(args.out) if args.out else None, settings=settings,
        ))
    print(f"report: {path}")
    return 0


def add_bench_parser(sub) -> None:
    """The `bench` subcommand on `kvloom`'s subparsers."""
    bench = sub.add_parser("bench", help="batching-strategy lab: replay a workload on kvloom strategies and peers")
    bench.add_argument("--workload", default="offline-mixed", choices=[*GENERATORS, MULTI_TENANT],
                       help=f"{MULTI_TENANT}: the tenant fairness benchmark (FCFS vs VTC; writes "
                            "benchmarks/results/fairness.md unless --out)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")
    bench.add_argument("--rates", type=_csv(float), default=[],
                       help="request rates (req/s), one run each, e.g. 0.1,0.2,0.4")
    bench.add_argument("--strategies", type=_csv(str), default=DEFAULT_STRATEGIES,
                       help=f"kvloom strategies (default: {','.join(DEFAULT_STRATEGIES)})")
    bench.add_argument("--peers", type=_csv(str), default=DEFAULT_PEERS, help="hf-static,hf-cb (empty: none)")
    bench.add_argument("--hf-batch-sizes", type=_csv(int), default=list(DEFAULT_HF_BATCHES))
    bench.add_argument("--hf-static-batches", type=int, default=1,
                       help="hf-static-B replays the first N*B requests: whole batches, a stated subset that keeps "
                            "W1 within 15 minutes on 2 cores (default 1; 0: the whole workload)")
    bench.add_argument("--peer-requests", type=int, default=32,
                       help="hf-cb replays the first N requests (default 32; 0: the whole workload)")
    bench.add_argument("--sweep", default=None, help="sweep one knob instead, e.g. max_num_seqs=1,4,16,64,256")
    bench.add_argument("--tpot-budget-ms", type=float, default=250.0, help="p99 TPOT budget for --sweep's pick")
    bench.add_argument("--speculative-config", type=json.loads, default=None,
                       help='speculation for every kvloom engine and vLLM offline, JSON in vLLM\'s shape, e.g. '
                            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
                            '(acceptance is reported; python -m kvloom.benchmarks.studies.speculation runs the full study)')
    bench.add_argument("--model", default="smollm2")
    bench.add_argument("--threads", type=int, default=2, help="torch threads, the same for every system")
    bench.add_argument("--max-num-seqs", type=int, default=64)
    bench.add_argument("--max-num-batched-tokens", type=int, default=2048)
    bench.add_argument("--kv-cache-gib", type=float, default=2.0)
    bench.add_argument("--no-prefix-caching", action="store_true")
    bench.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="kvloom's KV cache storage (peers keep the model dtype)")
    bench.add_argument("--timeout-s", type=float, default=600.0, help="limit per system run")
    bench.add_argument("--budget-min", type=float, default=14.0,
                       help="time budget per run (per rate): a system past its share is stopped and its finished "
                            "requests reported, flagged (default 14: W1 in 15 minutes; 0: none)")
    bench.add_argument("--no-roofline", action="store_true")
    bench.add_argument("--suite", action="store_true",
                       help="run the whole CPU report suite and write benchmarks/results/cpu.md")
    bench.add_argument("--out", default=None, help="output folder (default: benchmarks/out/<workload>)")
    bench.set_defaults(func=run_bench_command)
