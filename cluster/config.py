"""ClusterConfig: one YAML file describes a deployment (model, engine knobs, replicas, router, HTTP,
tenants)."""

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvloom.engine.config import EngineConfig, LoRAConfig
from kvloom.router.policies import PolicyConfig
from kvloom.router.tenants import TenantConfig, check_unique


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaResources(Strict):
    """What one replica asks Ray for; under tensor parallelism, what each of its ranks asks for (one bundle
    each, in one placement group per replica)."""

    num_cpus: float = Field(1, ge=0)
    num_gpus: float = Field(0, ge=0)
    placement_strategy: Literal["STRICT_PACK", "PACK"] = Field(
        "STRICT_PACK", description="a tensor-parallel replica's ranks: all on one node (STRICT_PACK: their "
                                   "all-reduces stay on the node's links), or packed where they fit (PACK)")
    torch_threads: int | None = Field(
        None, ge=1, description="intra-op threads per CPU replica; default: the node's CPUs split evenly "
                                "among the replicas on it (a lone replica uses them all)")


class RouterConfig(PolicyConfig, Strict):
    """Admission and replica choice; the queue policy knobs (policy, aging, VTC weights) are reloadable."""

    max_queued_requests: int = Field(512, ge=1)
    replica_slack: int = Field(4, ge=0, description="requests a replica may queue beyond max_num_seqs")
    imbalance_threshold: int = Field(8, ge=0, description="load gap that overrides prefix affinity")
    max_retries: int = Field(2, ge=0, description="times a request whose replica died moves to another one")
    stored_responses: int = Field(1000, ge=0, description="Responses API: responses kept for previous_response_id "
                                                          "and GET (the oldest go first)")
    stored_response_max_age_s: float = Field(86400, gt=0, description="Responses API: how long one is kept")
    retry_wait_s: float = Field(60, gt=0, description="how long a moved request waits for a replica before it "
                                                      "ends with an error")
    cold_start_timeout_s: float = Field(300, gt=0, description="how long a request waits for a replica while "
                                                               "none runs (scale from zero); then 503")
    max_request_bytes: int = Field(4 * 2**20, ge=1024, description="larger request bodies get 413")
    metrics_require_admin: bool = Field(False, description="GET /metrics asks for an admin key (its labels name "
                                                           "tenants)")


class DisaggregationConfig(Strict):
    """Prefill and decode on separate replicas, handing KV blocks over a transport."""

    enabled: bool = False
    prefill_replicas: int = Field(1, ge=1)
    decode_replicas: int = Field(1, ge=1)
    transport: Literal["torch_distributed", "object_store"] = "torch_distributed"
    transfer_timeout_s: float = Field(30, gt=0, description="torch_distributed: how long one transfer may take "
                                                           "once both sides are ready; past it the pair's channel "
                                                           "starts over and the decode replica computes the prompt")
    # each side may split its replicas differently (the hand-off carries every KV head, gathered from the
    # prefill replica's ranks and split among the decode replica's); default: engine.tensor_parallel_size
    prefill_tensor_parallel_size: int | None = Field(None, ge=1)
    decode_tensor_parallel_size: int | None = Field(None, ge=1)


class ScalingTarget(Strict):
    """The one load signal the autoscaler holds each replica at (cluster/autoscaling_policy.py)."""

    waiting_per_replica: float | None = Field(
        None, gt=0, description="requests waiting for a slot, in the engine or in the router's queue, per replica")
    kv_usage: float | None = Field(None, gt=0, le=1, description="the mean share of KV blocks in use")
    ttft_p90_s: float | None = Field(None, gt=0, description="the p90 time to first token clients see, requests "
                                                            "still waiting counted at their age")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ScalingTarget":
        chosen = [name for name, value in self if value is not None]
        if len(chosen) != 1:
            raise ValueError(f"set exactly one of {', '.join(type(self).model_fields)} (got {chosen or 'none'})")
        return self

    @property
    def signal(self) -> str:
        return next(name for name, value in self if value is not None)


class AutoscalingSettings(Strict):
    """kvloom's autoscaling: Serve's own autoscaler, driven by what says a replica is overloaded."""

    min_replicas: int = Field(1, ge=0, description="0: none run while idle; the first request waits while one "
                                                   "starts (router.cold_start_timeout_s)")
    max_replicas: int = Field(ge=1)
    target: ScalingTarget
    upscale_delay_s: float = Field(10, ge=0, description="how long the signal must ask for more before they come")
    downscale_delay_s: float = Field(60, ge=0, description="how long it must ask for fewer before they go")
    look_back_s: float = Field(5, gt=0, description="the window Serve averages the replicas' signals over")
    graceful_period_s: float = Field(30, ge=0, description="how long a replica chosen for removal keeps its "
                                                           "running requests; the rest then move to others")
    scale_for_priority: int | None = Field(None, description="only requests of this priority class or a better "
                                                             "(lower) one waiting in the router's queue count as "
                                                             "backlog (a batch class waits instead of adding "
                                                             "replicas); default: every class")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is over max_replicas ({self.max_replicas})")
        return self


class HTTPConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    access_log: bool = Field(False, description="one console line per HTTP request")
    drain_timeout_s: float = Field(30, ge=0, description="on SIGTERM or Ctrl-C, how long in-flight requests may "
                                                         "finish before the server stops")


class ClusterConfig(Strict):
    name: str = "kvloom"
    served_model_name: str | None = None
    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_replicas: int | None = Field(None, ge=1)
    autoscaling: AutoscalingSettings | None = None
    autoscaling_config: dict[str, Any] | None = None  # Serve's own, passed through as it is
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    router: RouterConfig = Field(default_factory=RouterConfig)
    http: HTTPConfig = Field(default_factory=HTTPConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    tenants: list[TenantConfig] = Field(default_factory=list, description="none: one anonymous tenant, no keys")
    admin_keys: list[str] = Field(default_factory=list, description="keys for admin endpoints (GET /v1/usage)")
    lora: LoRAConfig | None = Field(None, description="LoRA adapters served on the base model (engine/lora/); the "
                                                      "same as engine.lora")

    @model_validator(mode="after")
    def _lora_in_engine(self) -> "ClusterConfig":
        if self.lora is not None:
            if self.engine.lora is not None:
                raise ValueError("lora: set it once, at the top level or under engine")
            self.engine = EngineConfig(**{**self.engine.model_dump(exclude_unset=True), "lora": self.lora})
        return self

    @model_validator(mode="after")
    def _unique_tenants(self) -> "ClusterConfig":
        check_unique(self.tenants, self.admin_keys)
        return self



    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model


class ClusterConfigError(ValueError):
    pass


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Parse a YAML file; errors name the file and the offending key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ClusterConfigError(f"{path}: cannot read config: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ClusterConfigError(f"{path}: invalid YAML: {exc}") from exc
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(": ".join(filter(None, (".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, "))))
                             for e in exc.errors())
        raise ClusterConfigError(f"{path}: {problems}") from exc
    scaling = [key for key in ("num_replicas", "autoscaling", "autoscaling_config") if getattr(config, key)]
    if len(scaling) > 1:
        raise ClusterConfigError(f"{path}: {scaling[1]}: set only one of {', '.join(scaling)}")
    return config
