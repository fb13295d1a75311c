"""The `kvloom` command line."""

import argparse
import sys
import time
from pathlib import Path

STATUS_EVENTS = 10  # scaling events `kvloom status` shows, the latest last


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
    router = serve.get_deployment_handle(ROUTER_NAME, args.name)
    replicas = router.replica_stats.remote().result()
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
        if r["startup"]:
            phases = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in r["startup"].items())
            print(f"  started in {sum(r['startup'].values()):.1f} s: {phases}")
        for rank in r["ranks"]:
            print("  " + describe_rank(rank, r["ranks"]))
        if handoffs := r.get("handoffs"):
            received = handoffs["received"]
            print(f"  hand-offs: {received:.0f} received ({handoffs['bytes'] / 2**20:.1f} MiB, "
                  f"{handoffs['transfer_s'] / max(received, 1) * 1000:.1f} ms each), "
                  f"{handoffs['computed_here']:.0f} computed here instead")
        for tier, t in ((name, t) for name, t in (r.get("kv_tiers") or {}).items() if isinstance(t, dict)):
            print(f"  KV {tier} tier: {t['used_bytes'] / 2**20:.0f} MiB held on the node, {t['hits']} blocks read "
                  f"back ({t['load_s'] * 1000:.0f} ms), {t['misses']} missed, {t['blocks_written']} written")
    events = router.scaling_events.remote().result()[-STATUS_EVENTS:]
    if events:
        print("replicas over time (the router's load signals when each joined or left):")
    for e in events:
        change = " ".join([*(f"+{r}" for r in e["joined"]), *(f"-{r}" for r in e["left"])])
        print(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))}  {e['replicas']} replica(s)  {change}  "
              f"waiting/replica {e['waiting_per_replica']:.1f}  running {e['running']}  kv used {e['kv_usage']:.1%}"
              f"  ttft p90 {e['ttft_p90_s']:.2f} s  queued {e['queued']}")
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

    from kvloom.benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvloom.cluster.config import ClusterConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ClusterConfigError as exc:  # it names the file and the key: one line, no traceback
        print(f"kvloom {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
