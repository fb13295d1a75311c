"""`kvloom serve`: start (or join) a Ray cluster, deploy, print what serves where, and stop cleanly.

SIGTERM (what systemd, `docker stop` and Kubernetes send) and Ctrl-C drain: the router answers 503 to new
requests and to /health, in-flight requests may finish for `http.drain_timeout_s`, then Serve and the Ray
cluster this command started shut down and it exits 0. A second signal stops at once. Ray installs its
own SIGTERM handler when it starts, so ours goes in after `ray.init`.
"""

import argparse
import logging
import os
import signal
import sys
import time

from kvloom.cluster.config import ClusterConfig, load_cluster_config
from kvloom.cluster.logs import JSONConsole, say
from kvloom.cluster.ports import listened_on
from kvloom.replicas.serve_logs import LOG_FORMAT_ENV, json_logs, serve_logger_as_json

DRAIN_POLL_S = 0.2
ROUTER_CALL_TIMEOUT_S = 10


def own_cluster_env(port: int) -> dict[str, str]:
    """Ray Serve settings for a Ray cluster that `kvloom serve` starts itself (its processes inherit them).

    Direct ingress: the router deployment answers HTTP on `port` in its own process instead of behind Serve's
    proxy actor (one hop, one process and one JSON re-framing less per streamed token); Serve still starts its
    proxy, on a port of its own, as the fallback route, and no load balancer stands in front, so no 30 s drain
    window. And a quieter idle cluster, since each wake-up of its processes takes a core from the engine: slower
    Serve control and metrics loops, Ray's own metrics off (kvloom's are the router's /metrics), task events,
    resource reports, memory and GC checks less often, and the log monitor globbing for new files every 0.5 s
    rather than on every 0.1 s poll (new lines still reach the console within 0.1 s). The measurements behind
    each: docs/performance.md, "Design choices"."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1), "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
            "RAY_enable_metrics_collection": "0", "RAY_task_events_report_interval_ms": "10000",
            "RAY_raylet_report_resources_period_milliseconds": "1000", "RAY_memory_monitor_refresh_ms": "1000",
            "RAY_raylet_check_gc_period_milliseconds": "1000", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


def batch_scheduling() -> bool:
    """Put this process, and so every process of the Ray cluster it then starts, in Linux's SCHED_BATCH class:
    a thread of that class that wakes does not preempt a running one; it takes a free core, or waits for the
    next scheduler tick. The engine's threads leave the class (engine/cpu_threads.py), so their own wake-ups
    still preempt: Ray's frequent wake-ups (signal checks, gRPC polls, each streamed step's hops) stop
    preempting the engine (evidence: docs/performance.md). Nothing runs at a lower priority: each thread keeps
    its nice value and its fair share of CPU time. False where the OS has no such class."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        return False
    return True


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def describe_rank(rank: dict, ranks: list[dict]) -> str:
    """One tensor-parallel rank: where it runs and its share (uneven splits show in the KV heads and bytes)."""
    kv_total = sum(r["kv_heads"][1] - r["kv_heads"][0] for r in ranks)
    weights = rank["weight_bytes"] / sum(r["weight_bytes"] for r in ranks)
    heads, kv = rank["heads"], rank["kv_heads"]
    return (f"rank {rank['rank']}: {rank['placement']}; query heads {heads[0]}-{heads[1] - 1}, KV heads "
            f"{kv[0]}-{kv[1] - 1} ({kv[1] - kv[0]} of {kv_total}), {weights:.1%} of the weights "
            f"({rank['weight_bytes'] / 2**20:.0f} MiB), KV pool {rank['kv_bytes'] / 2**20:.0f} MiB")


def _startup_summary(config: ClusterConfig, replicas: list[dict]) -> None:
    for r in replicas:
        tokens = r["num_blocks"] * r["block_size"]
        ranks = r["tensor_parallel_size"]
        say(f"  replica {r['replica_id']}: {r['device']}, {r['dtype']}, {r['torch_threads']} torch thread(s)"
            f"{f' on each of {ranks} tensor-parallel ranks' if ranks > 1 else ''}, "
            f"{r['num_blocks']} KV blocks ({tokens} tokens), up to {r['max_num_seqs']} sequences",
            replica=r["replica_id"], device=r["device"], dtype=r["dtype"], torch_threads=r["torch_threads"],
            tensor_parallel_size=ranks, kv_blocks=r["num_blocks"], kv_tokens=tokens, max_num_seqs=r["max_num_seqs"])
        for rank in r["ranks"]:
            say("    " + describe_rank(rank, r["ranks"]), replica=r["replica_id"], rank=rank["rank"])
    url = f"http://{config.http.host}:{config.http.port}"
    say(f"kvloom is serving {config.model_name} with {len(replicas)} replica(s) at {url}/v1  (Ctrl-C stops)",
        model=config.model_name, replicas=len(replicas), url=f"{url}/v1")
    say(f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{config.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'")


def _submitted_router(app_name: str):
    """The router's handle once its app was submitted (a stop may come while `serve.run` waits for replicas)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from kvloom.cluster.app import ROUTER_NAME

    try:
        return serve.get_deployment_handle(ROUTER_NAME, app_name)
    except (KeyError, RayServeException):  # not submitted yet: no router took a request
        return None


def _drain(router, timeout_s: float) -> None:
    """Stop admitting, then wait (a bounded poll) for the requests in flight to finish. A stop during start-up
    drains too: the router may already answer HTTP while the replicas load (it then refuses what it queued)."""
    from ray.serve.exceptions import RayServeException

    try:
        in_flight = router.drain.remote().result(timeout_s=ROUTER_CALL_TIMEOUT_S)
    except (TimeoutError, RayServeException):
        return  # no router yet (no app, or its replica still starting), so it accepted no request
    say(f"draining: new requests get 503; {in_flight} in flight, waiting up to {timeout_s:g} s (again to stop now) ...",
        in_flight=in_flight)
    deadline = time.monotonic() + timeout_s
    while in_flight and time.monotonic() < deadline:
        time.sleep(DRAIN_POLL_S)
        in_flight = router.in_flight.remote().result()
    if in_flight:
        say(f"drain timeout: stopping with {in_flight} request(s) still in flight", in_flight=in_flight)


def serve_main(args: argparse.Namespace) -> int:
    config = load_cluster_config(args.config)
    if args.port is not None:
        config = config.model_copy(update={"http": config.http.model_copy(update={"port": args.port})})
    proxy_port, batched = config.http.port, False
    if args.address is None and listened_on(config.http.host, config.http.port):  # the router would run here
        print(f"kvloom serve: port {config.http.port} on {config.http.host} is in use by another program; stop "
              f"it, or choose another port with http.port in {args.config} or --port", file=sys.stderr)
        return 1
    if args.address is None:  # our own cluster: its processes inherit this environment
        os.environ.update(own_cluster_env(config.http.port))
        batched = batch_scheduling()
        proxy_port = 0  # the fallback proxy binds whatever port is free when it starts: a port picked before
        # Ray's daemons start can be taken by one of them by then (seen: "Failed to bind to address")
    import ray
    from ray import serve

    from kvloom.cluster.app import ROUTER_NAME, build_app, expected_replicas
    from kvloom.cluster.ray_auth import use_token_for_address

    encoding = "JSON" if args.log_format == "json" else "TEXT"
    os.environ[LOG_FORMAT_ENV] = args.log_format  # for `say`, and the processes of a cluster started here
    if json_logs():
        sys.stdout, sys.stderr = JSONConsole(sys.stdout), JSONConsole(sys.stderr)
    logging.getLogger("ray.serve").setLevel(args.log_level)  # this process's Serve client lines too
    serve_logger_as_json()
    use_token_for_address(args.address)
    ray.init(address=args.address, include_dashboard=False, logging_level=args.log_level,
             logging_config=ray.LoggingConfig(encoding=encoding, log_level=args.log_level) if encoding == "JSON"
             else None)
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which replaces SIGTERM's handler
        signal.signal(signum, _raise_interrupt)
    router = None
    try:
        serve.start(http_options={"host": config.http.host, "port": proxy_port},
                    logging_config={"log_level": args.log_level, "encoding": encoding, "enable_access_log": False})
        say(f"deploying {config.model_name} from {args.config} ...")
        if batched:
            say("  the Ray cluster started here schedules as SCHED_BATCH: a thread that wakes waits for a free core "
                "or the next tick instead of preempting the engine's", scheduling="batch")
        serve.run(build_app(config, args.log_level, encoding), name=config.name, route_prefix="/")
        router = serve.get_deployment_handle(ROUTER_NAME, config.name)
        while len(replicas := router.replica_stats.remote().result()) < expected_replicas(config):
            time.sleep(0.5)
        _startup_summary(config, replicas)
        address = ray.get_runtime_context().gcs_address
        say(f"  replicas and their ranks: kvloom status --address {address}", ray_address=address)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        router = router or _submitted_router(config.name)
        if router is not None:
            try:
                _drain(router, config.http.drain_timeout_s)
            except KeyboardInterrupt:
                say("stopping now")
    finally:
        say("shutting down ...")
        if args.address is not None:  # a cluster someone else runs: Serve leaves it in order
            serve.shutdown()
        ray.shutdown()  # a cluster started here goes with its processes (the drain has ended what was in flight)
    return 0
