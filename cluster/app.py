"""Builds the Serve application: a Router ingress bound to a pool of EngineReplica deployments.

`build_app(config)` returns a Serve Application; `app_builder` lets `serve run` / `serve deploy`
use it directly: `serve run kvloom.cluster.app:app_builder config=configs/local-cpu.yaml`.

Tenants, admin keys and the queue policy travel as the Router's `user_config` (keys already
hashed), so a Serve config deploy that changes only them reloads the router in place.
When the router policy relies on engine preemption (priority classes, fair-share preemption),
replicas run the engine's priority scheduler (unless the config sets one) and accept the
router's preemption headroom.
"""

import hashlib
import json
import time

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvloom.cluster.autoscaling_policy import serve_autoscaling_config
from kvloom.cluster.config import ClusterConfig, load_cluster_config
from kvloom.replicas.serve_logs import LOG_FORMAT_ENV
from kvloom.engine.cpu_threads import openmp_env
from kvloom.replicas.disagg import DecodeReplica, PrefillReplica
from kvloom.replicas.engine_replica import EngineReplica
from kvloom.router.policies import PolicyConfig
from kvloom.router.replica_table import PREEMPTION_HEADROOM
from kvloom.router.request_router import TargetedRequestRouter
from kvloom.router.server import Router, TenancySettings
from kvloom.router.tenants import key_digest

ROUTER_NAME = "Router"
REPLICA_NAME = "EngineReplica"
PREFILL_NAME = "PrefillReplica"
DECODE_NAME = "DecodeReplica"
DEFAULT_GRACE_S = 5.0  # a stopping replica's running requests get this long before they move (router/membership.py)
MOVE_MARGIN_S = 5.0  # Serve's own timeout is longer by this: the router moves the requests before Serve ends it
# how often a stopping replica (or router) checks that its calls are done; Serve's default 2 s was most of a redeploy
STOP_POLL_S = 0.25
HEALTH_CHECK_S = 2.0  # how often Serve checks that the router and each replica live (a dead one is replaced)


def tenancy_user_config(config: ClusterConfig) -> dict:
    """The Router's reloadable settings, with every key replaced by its digest."""
    return TenancySettings(
        **config.router.model_dump(include=set(PolicyConfig.model_fields)),
        tenants=[t.hashed() for t in config.tenants],
        admin_keys=[key_digest(k) for k in config.admin_keys],
    ).model_dump(mode="json")


def build_app(config: ClusterConfig, log_level: str = "INFO", log_encoding: str = "TEXT") -> serve.Application:
    """No access-log line for the replicas' calls: the router's submits and channel reads and their stats
    pushes twice a second are internal traffic (each line also cost time in the engine's process). The
    router logs one line per HTTP request only if `http.access_log` asks."""
    if config.autoscaling:
        scaling = {"autoscaling_config": serve_autoscaling_config(config.autoscaling, config.engine.max_num_seqs)}
    elif config.autoscaling_config:
        scaling = {"autoscaling_config": config.autoscaling_config}
    else:
        scaling = {"num_replicas": config.num_replicas or 1}
    resources = config.resources
    grace_s = config.autoscaling.graceful_period_s if config.autoscaling else DEFAULT_GRACE_S
    credit = config.engine.max_num_seqs + config.router.replica_slack
    preempts = config.router.engine_preempts
    logs = {"log_level": log_level, "encoding": log_encoding, "enable_access_log": False}
    # JSON: Serve's console lines too (see cluster/logs.py); text needs nothing in the processes' environment
    log_format = {LOG_FORMAT_ENV: "json"} if log_encoding == "JSON" else {}

    rank_resources = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}

    def replica_deployment(cls, name: str, replica_scaling: dict, ranks: int):
        # a tensor-parallel replica: one bundle per rank, in a placement group Serve makes (and remakes) per replica
        placement = {"placement_group_bundles": [{"CPU": resources.num_cpus, "GPU": resources.num_gpus}] * ranks,
                     "placement_group_strategy": resources.placement_strategy} if ranks > 1 else {}
        return serve.deployment(cls).options(
            name=name,
            ray_actor_options={"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus,
                               "runtime_env": {"env_vars": {**openmp_env(), **log_format}}},
            max_ongoing_requests=credit * (PREEMPTION_HEADROOM if preempts else 1),
            request_router_config=RequestRouterConfig(request_router_class=TargetedRequestRouter,
                                                      request_router_kwargs={"deployment": name}),
            health_check_period_s=HEALTH_CHECK_S,
            health_check_timeout_s=30,
            graceful_shutdown_timeout_s=grace_s + MOVE_MARGIN_S,
            graceful_shutdown_wait_loop_s=STOP_POLL_S,
            logging_config=logs,
            **placement,
            **replica_scaling,
        )

    router = serve.deployment(Router).options(
        name=ROUTER_NAME, num_replicas=1, max_ongoing_requests=100_000, graceful_shutdown_wait_loop_s=STOP_POLL_S,
        health_check_period_s=HEALTH_CHECK_S,  # Serve's default 10 s: a dead router went unnoticed up to that long
        ray_actor_options={"num_cpus": 0, **({"runtime_env": {"env_vars": log_format}} if log_format else {})},
        user_config=tenancy_user_config(config), logging_config={**logs, "enable_access_log": config.http.access_log},
    )
    settings = {
        "served_model_name": config.model_name,
        "model": config.engine.model,
        "block_size": config.engine.block_size,
        "replica_deployment": REPLICA_NAME,
        "replica_grace_s": grace_s,
        "scales_from_zero": expected_replicas(config) == 0,
        "scale_for_priority": config.autoscaling.scale_for_priority if config.autoscaling else None,
        "lora": config.engine.lora.model_dump() if config.engine.lora else None,
        "tool_call_parser": config.engine.tool_call_parser,
        **config.router.model_dump(exclude=set(PolicyConfig.model_fields)),
    }
    engine = config.engine.model_dump(exclude_unset=True)
    # what the router and engines are deployed with, tenancy aside (reloaded in place): adapters loaded at run time
    # are kept while it stays the same (router/adapter_ledger.py)
    deployed = [settings, engine, config.disaggregation.model_dump(), config.resources.model_dump()]
    digest = hashlib.sha1(json.dumps(deployed, sort_keys=True, default=str).encode())
    settings["deployment_id"] = digest.hexdigest()[:16]
    if preempts:
        engine.setdefault("scheduling_policy", "priority")
    replica_args = {"router_name": ROUTER_NAME, "torch_threads": resources.torch_threads,
                    "rank_resources": rank_resources, "deployment_id": settings["deployment_id"]}
    disagg = config.disaggregation
    if disagg.enabled:
        settings["disagg_transport"] = disagg.transport
        ranks = config.engine.tensor_parallel_size
        prefill_ranks = disagg.prefill_tensor_parallel_size or ranks
        decode_ranks = disagg.decode_tensor_parallel_size or ranks
        prefill = replica_deployment(PrefillReplica, PREFILL_NAME, {"num_replicas": disagg.prefill_replicas},
                                     prefill_ranks)
        decode = replica_deployment(DecodeReplica, DECODE_NAME, {"num_replicas": disagg.decode_replicas}, decode_ranks)
        handoff_args = {**replica_args, "transfer_timeout_s": disagg.transfer_timeout_s}
        return router.bind(prefill.bind({**engine, "tensor_parallel_size": prefill_ranks}, **handoff_args), settings,
                           decode.bind({**engine, "tensor_parallel_size": decode_ranks}, **handoff_args))
    replicas = replica_deployment(EngineReplica, REPLICA_NAME, scaling, config.engine.tensor_parallel_size)
    return router.bind(replicas.bind(engine, **replica_args), settings)


def expected_replicas(config: ClusterConfig) -> int:
    if config.disaggregation.enabled:
        return config.disaggregation.prefill_replicas + config.disaggregation.decode_replicas
    if config.autoscaling:
        return config.autoscaling.min_replicas
    return config.num_replicas or (config.autoscaling_config or {}).get("min_replicas", 1)


def deploy(config: ClusterConfig, app_name: str | None = None, timeout_s: float = 300):
    """Deploy on the connected Ray cluster (Serve already started) and wait until the router sees
    every replica; returns the router's handle."""
    app_name = app_name or config.name
    serve.run(build_app(config), name=app_name, route_prefix="/")
    router = serve.get_deployment_handle(ROUTER_NAME, app_name)
    wanted = expected_replicas(config)
    deadline = time.monotonic() + timeout_s
    while len(router.replica_stats.remote().result()) < wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{wanted} replica(s) did not report within {timeout_s} s")
        time.sleep(0.25)
    return router


def app_builder(args: dict) -> serve.Application:
    """Entry point for `serve run kvloom.cluster.app:app_builder config=PATH`."""
    config = load_cluster_config(args["config"]) if "config" in args else ClusterConfig()
    return build_app(config)
