"""What crosses between the router and the engine replicas, one type a purpose.

`SubmitRequest` goes to a replica once per request: a pydantic model, validated where it arrives, carrying the
request's `SamplingParams` as itself (a missing `max_tokens` is resolved once, by the engine). What comes back
is cheaper: plain dataclasses on the per-token path, as cheap to build and pickle as the dicts they replaced.
A `Chunk` is one request's output of one engine step; `StepChunks` carries a step's chunks for one output
channel; `SubmitReply` answers a submit. None of them imports torch: the router never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kvloom.engine.lora.identity import LoRARequest
from kvloom.engine.sampling import SamplingParams


class Continuation(BaseModel):
    """The output a client already has of a stream whose replica died: the new replica goes on from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output_token_ids: list[int] = Field(min_length=1)
    emitted_chars: int = Field(0, ge=0)  # of the output's text, what the client received


class SubmitRequest(BaseModel):
    """One request for an engine replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str = Field(min_length=1)
    prompt_token_ids: list[int]  # checked by the engine, whose errors name the HTTP request's `prompt`
    sampling: SamplingParams
    engine_priority: int = 0  # the engine's scheduling priority (lower runs first): the tenant's class, aged
    yields_prefill: bool = False  # its tenant is over its share: its prompt goes in chunks (engine/prefill_yield.py)
    fork_of: str | None = None  # a request whose prompt KV this one shares (a prompt's later choices)
    continuation: Continuation | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    cache_namespace: int | None = Field(None, ge=0, lt=2**128)  # its tenant's prefix-cache root (cache_namespace.py)


@dataclass
class ReplicaError:
    """Why a replica refused a request: the message and the request field at fault."""

    message: str
    param: str | None = None


@dataclass
class Handoff:
    """A prefill replica parked a request's KV: decode it elsewhere."""

    prefill_replica: str
    num_tokens: int


@dataclass
class Chunk:
    """One request's output of one engine step (or its refusal): what is new since the last chunk, and counts
    so far."""

    replica: str
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per new token, {token id: logprob} of the top alternatives
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: ReplicaError | None = None
    handoff: Handoff | None = None  # disaggregation: the rest is decoded elsewhere
    kv_received: bool = False  # disaggregation: the decode replica holds the KV (no output in this chunk)
    prompt_logprobs: list[tuple[int, dict[int, float]] | None] | None = None  # asked for: in the first chunk

    @property
    def finished(self) -> bool:
        return self.error is not None or self.finish_reason is not None


@dataclass(frozen=True)
class ActorName:
    """A named Ray actor (the router that reads an output channel): the replica checks it still lives."""

    name: str
    namespace: str

    def alive(self) -> bool:
        import ray

        try:
            ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:  # no live actor has that name
            return False
        return True


@dataclass(frozen=True)
class OutputAddress:
    """Where a replica serves an output channel over TCP (replicas/output_socket.py), and the one-time token the
    channel's reader sends first."""

    host: str
    port: int
    token: bytes


@dataclass
class StepChunks:
    """A step's chunks for the requests of one output channel, from one replica; a channel's first item names
    the replica (and, where asked for, the socket its steps go out on)."""

    replica: str
    chunks: list[Chunk] = field(default_factory=list)
    address: OutputAddress | None = None


@dataclass
class SubmitReply:
    """Which replica took a request, or why it refused it."""

    replica: str
    error: ReplicaError | None = None


@dataclass
class ReplicaStats:
    """What a replica pushes to the router every fraction of a second: who it is, how loaded, what it caches.
    The router's `replica_stats` shows them (with its own counts) to `kvloom status`, metrics and tests."""

    replica_id: str
    role: str = "colocated"  # or "prefill", "decode"
    # the app deployment it was started for (cluster/app.py): a router records only its own deployment's
    # replicas (router/replica_table.py)
    deployment_id: str | None = None
    node_id: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    torch_threads: int = 1
    tensor_parallel_size: int = 1
    ranks: list[dict] = field(default_factory=list)  # per tensor-parallel rank: placement, heads, bytes held
    max_num_seqs: int = 1
    block_size: int = 16
    max_model_len: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    engine_steps: int = 0
    engine_step_requests: int = 0
    engine_step_seconds: float = 0.0
    spec_decode: dict | None = None  # SpecDecodeStats as a dict, where the engine speculates
    kv_tiers: dict | None = None  # per KV tier (engine/kv_tiers/): hits, misses, blocks written, bytes, seconds
    cached_prefix_hashes: list[int] = field(default_factory=list)  # the most recent, for prefix affinity
    # the most recent of the blocks its node's KV tiers hold, as it wrote or read them: cheaper hits for the router,
    # which pools them over the replicas of one node (`node_id`)
    tier_prefix_hashes: list[int] = field(default_factory=list)
    kv_store: str | None = None  # a decode replica's KV transfer rendezvous (host:port)
    handoffs: dict[str, float] | None = None  # a decode replica's hand-offs: received (bytes, seconds), computed here
    startup: dict[str, float] = field(default_factory=dict)  # how long each part of its start took (seconds)
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters loaded (the router sends theirs here)
    healthy: bool = True
    time: float = 0.0


@dataclass
class RouterView:
    """The router's answer to a replica's stats: how many live replicas share its node (they split its cores),
    the requests queued in the router per live replica (the backlog the autoscaler sees) and the p90 time to
    first token its clients see now."""

    replicas_on_node: int
    queued_per_replica: float
    ttft_p90_s: float = 0.0
