"""The `kvloom` command line."""

import argparse
import json
import sys
import time
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    from kvloom.engine.llm import LLM
    from kvloom.engine.sampling import SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = args.prompt or ["Explain in two sentences why the sky is blue."]
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        tokens += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")
    print(f"{len(prompts)} prompts, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tok/s)")
    return 0


MULTI_TENANT = "multi-tenant"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local-cpu.yaml"


def _connect(address: str | None) -> None:
    import ray

    from kvloom.cluster.ray_auth import use_token_for_address

    use_token_for_address(address)
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)


def _serve(args: argparse.Namespace) -> int:
    from kvloom.cluster.serve_command import serve_main

    return serve_main(args)


def _status(args: argparse.Namespace) -> int:
    from ray import serve

    from kvloom.cluster.app import ROUTER_NAME
    from kvloom.cluster.serve_command import describe_rank

    _connect(args.address)
    replicas = serve.get_deployment_handle(ROUTER_NAME, args.name).replica_stats.remote().result()
    print(f"{len(replicas)} replica(s)")
    header = (f"{'replica':<10} {'device':<7} {'dtype':<9} {'tp':>3} {'threads':>7} {'running':>7} {'waiting':>7} "
              f"{'inflight':>8} {'kv used':>8} {'prefix hit':>10} {'preempt':>7} {'steps':>8} {'batch':>5}")
    print(header)
    for r in replicas:
        hit = r["prefix_cache_hits"] / r["prefix_cache_queries"] if r["prefix_cache_queries"] else 0.0
        batch = r["engine_step_requests"] / r["engine_steps"] if r["engine_steps"] else 0.0  # mean since start
        print(f"{r['replica_id']:<10} {r['device']:<7} {r['dtype']:<9} {r['tensor_parallel_size']:>3} "
              f"{r['torch_threads']:>7} {r['num_running']:>7} {r['num_waiting']:>7} {r['inflight']:>8} "
              f"{r['kv_cache_usage']:>8.1%} {hit:>10.1%} {r['num_preemptions']:>7} {r['engine_steps']:>8} {batch:>5.1f}")
        for rank in r["ranks"]:
            print("  " + describe_rank(rank, r["ranks"]))
    return 0


def _csv(cast):
    return lambda text: [cast(v) for v in text.split(",") if v]


def _bench(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom", description="kvloom LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation on one engine (no Ray)")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one example)")
    gen.add_argument("--model", default=None, help="smollm2 (default), a HF directory or a .gguf file")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="deploy the OpenAI-compatible server on Ray Serve")
    srv.add_argument("--config", default=str(DEFAULT_CONFIG), help="cluster YAML (default: configs/local-cpu.yaml)")
    srv.add_argument("--address", default=None, help="Ray cluster to join (auto, ray://host:port); default: start a local one")
    srv.add_argument("--port", type=int, default=None, help="override http.port")
    srv.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="console and Serve log level (default WARNING: the startup summary, warnings, errors)")
    srv.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one JSON object a line")
    srv.set_defaults(func=_serve)

    st = sub.add_parser("status", help="show the replicas of a running deployment")
    st.add_argument("--address", default="auto")
    st.add_argument("--name", default="kvloom", help="application name (config `name`)")
    st.set_defaults(func=_status)

    from kvloom.benchmarks.bench import DEFAULT_HF_BATCHES, DEFAULT_PEERS, DEFAULT_STRATEGIES
    from kvloom.benchmarks.workloads import GENERATORS

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
                            '(acceptance is reported; python -m kvloom.benchmarks.speculation runs the full study)')
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
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
