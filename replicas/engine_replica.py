"""EngineReplica: one AsyncLLMEngine per Ray Serve replica (a GPU, or a CPU slot).

The router submits requests with a short call and reads every request's chunks back over one output channel
per router process, a step's worth per message (see router/channels.py; the messages: replicas/messages.py).
Bad input is answered with an error reply instead of an exception, so the router can answer 400 before any
byte is sent. Stats go to the router every `stats_period_s`, which is how the
router learns which replicas exist, how loaded they are and which prefixes they hold. The router answers
each push with the number of replicas on this replica's node, so that CPU replicas split the node's
cores between them: a lone one uses them all (unless the config fixes `torch_threads`).

The engine (torch, transformers) is imported inside the actor, not by this module: `kvloom serve`'s
driver imports the deployment classes to deploy them and would otherwise keep ~250 MB of torch mapped
for as long as it serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import ray
from pydantic import ValidationError
from ray import serve

from kvloom.replicas.off_loop_preparation import OffLoopPreparation
from kvloom.replicas.output_socket import Lease, OutputServer, ray_uses_tls
from kvloom.replicas.serve_logs import serve_logger_as_json
from kvloom.engine.config import EngineConfig
from kvloom.engine.cpu_threads import share_of_node, usable_cpus
from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.lora.identity import LoRARequest
from kvloom.engine.outputs import RequestOutput
from kvloom.replicas.messages import (ActorName, Chunk, OutputAddress, ReplicaError, ReplicaStats, RouterView,
                                     StepChunks, SubmitReply, SubmitRequest)

if TYPE_CHECKING:
    from kvloom.engine.async_engine import OutputBatches
    from kvloom.engine.request import Request

logger = logging.getLogger(__name__)
PREFIX_SUMMARY_SIZE = 4096  # most recent cached-block hashes published for prefix affinity
TIER_SUMMARY_SIZE = 4096  # likewise of the blocks the node's KV tiers hold (cheaper hits for the router)
# how often an output channel checks that the router reading it still lives: Ray does not end a stream whose caller
# was killed, and an open one runs its requests for nobody and holds this replica's stop for Serve's graceful period
CALLER_CHECK_S = 1.0


async def ended_within(event: asyncio.Event, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def engine_device(config: EngineConfig) -> EngineConfig:
    """Use CUDA only when Ray gave this actor a GPU that torch can see; say so either way."""
    import torch

    if config.device != "auto":
        return config
    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    if gpu_ids and torch.cuda.is_available():
        logger.info("kvloom replica runs on CUDA (Ray GPU ids %s)", gpu_ids)
        return config.model_copy(update={"device": "cuda"})
    if gpu_ids:
        logger.warning("kvloom replica was given GPU ids %s but no CUDA device exists: running on CPU", gpu_ids)
    else:
        logger.info("kvloom replica runs on CPU")
    return config.model_copy(update={"device": "cpu"})


def rank_summary(report) -> dict:
    """A tensor-parallel rank as `kvloom status` shows it."""
    shard = report.shard
    return {"rank": shard.rank, "placement": report.placement, "heads": list(shard.heads),
            "kv_heads": list(shard.kv_heads), "weight_bytes": report.weight_bytes, "kv_bytes": report.kv_bytes}


def request_for(engine, message: SubmitRequest | dict) -> Request:
    """The engine's request for a router's message (a dict is validated as one first). Every role builds it here
    (colocated, prefill, decode, a replica taking over a cut stream), so what the message carries reaches each:
    the adapter, the tenant's prefix-cache namespace, the sibling whose KV it forks."""
    message = SubmitRequest.model_validate(message)
    req = engine.make_request(message.request_id, message.prompt_token_ids, message.sampling, message.engine_priority,
                              lora=message.lora, cache_namespace=message.cache_namespace)
    req.fork_of = message.fork_of
    req.yields_prefill = message.yields_prefill
    return req


class EngineReplica:
    role = "colocated"

    async def __init__(self, engine_config: dict, router_name: str | None = None, stats_period_s: float = 0.5,
                       torch_threads: int | None = None, rank_resources: dict | None = None,
                       deployment_id: str | None = None) -> None:
        """`rank_resources`: num_cpus and num_gpus of each tensor-parallel rank's bundle; `deployment_id`: the
        app deployment this replica serves (its stats say so)."""
        import psutil

        from kvloom.engine.async_engine import AsyncLLMEngine

        # Ray starting the actor's process, Serve's replica wrapper and the imports, up to this constructor
        self.process_start_s = time.time() - psutil.Process().create_time()
        self.deployment_id = deployment_id
        serve_logger_as_json()
        self.config = engine_device(EngineConfig(**engine_config))
        self.cpus = usable_cpus()
        # a tensor-parallel replica splits its threads among its ranks once, at start (see tp_runner.py)
        self.fixed_threads = torch_threads or self.config.tensor_parallel_size > 1
        self.threads = torch_threads or self.cpus  # a lone replica until the router counts others beside it
        launch = None
        if self.config.tensor_parallel_size > 1:
            from kvloom.replicas.tp_workers import ray_launch

            launch = ray_launch(self.config.device, **(rank_resources or {"num_cpus": 1, "num_gpus": 0}))
        self.engine = await asyncio.to_thread(AsyncLLMEngine, self.config, self.threads, launch)
        if launch:
            self.threads = self.engine.step_threads
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        logger.info("kvloom replica %s: %d torch thread(s) of the %d CPU(s) it may use (%s)", self.replica_id,
                    self.threads, self.cpus, "fixed by torch_threads" if torch_threads else "alone on its node so far")
        self.node_id = ray.get_runtime_context().get_node_id()
        self.channels: dict[str, OutputBatches] = {}  # one per router process: its requests' outputs
        self.output_server = OutputServer(ray.util.get_node_ip_address(), self.steps)
        self.told_no_socket = False
        self.preparing = OffLoopPreparation()  # requests naming an adapter are made off this loop (it may read disk)
        self._stats_task = None
        self.router_view = RouterView(replicas_on_node=1, queued_per_replica=0.0)  # as the router last said
        if router_name:
            router = serve.get_deployment_handle(router_name, context.app_name)
            self._stats_task = asyncio.get_running_loop().create_task(self._push_stats(router, stats_period_s))

    async def _push_stats(self, router, period_s: float) -> None:
        while True:
            try:
                view = await router.report_replica_stats.remote(self.stats())
            except Exception as exc:  # the router may be starting or restarting; keep trying
                logger.debug("stats push failed: %r", exc)
            else:
                self.router_view = view
                self.share_node(view.replicas_on_node)
            await asyncio.sleep(period_s)

    def share_node(self, replicas_on_node: int) -> None:
        """Take an even share of the node's cores (a CPU replica whose config does not fix its threads)."""
        if self.fixed_threads or self.engine.device.type != "cpu":
            return
        threads = share_of_node(self.cpus, replicas_on_node)
        if threads != self.threads:
            logger.info("kvloom replica %s: %d torch thread(s): %d replicas share the node's %d CPU(s)",
                        self.replica_id, threads, replicas_on_node, self.cpus)
            self.threads = threads
            self.engine.set_num_threads(threads)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What kvloom's autoscaling policy scales on (cluster/autoscaling_policy.py); Serve polls it."""
        s, view = self.engine.stats(), self.router_view
        return {"waiting": s.num_waiting + view.queued_per_replica, "running": float(s.num_running),
                "kv_usage": s.kv_cache_usage, "ttft_p90_s": view.ttft_p90_s}

    def stats(self) -> ReplicaStats:
        report = self.engine.report(PREFIX_SUMMARY_SIZE, TIER_SUMMARY_SIZE)
        s = report.stats
        return ReplicaStats(
            replica_id=self.replica_id, role=self.role, deployment_id=self.deployment_id, node_id=self.node_id,
            device=report.device, dtype=report.dtype, torch_threads=self.threads,
            tensor_parallel_size=self.config.tensor_parallel_size,
            ranks=[rank_summary(r) for r in report.ranks], max_num_seqs=self.config.max_num_seqs,
            block_size=report.block_size, max_model_len=report.max_model_len,
            num_running=s.num_running, num_waiting=s.num_waiting, num_blocks=s.num_blocks,
            num_free_blocks=s.num_free_blocks, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, engine_steps=s.num_steps, engine_step_requests=s.batch_slots,
            engine_step_seconds=s.step_seconds,
            spec_decode=report.spec_decode, kv_tiers=s.kv_tiers, cached_prefix_hashes=report.recent_prefix_hashes,
            tier_prefix_hashes=report.recent_tier_hashes,
            startup={"process start": self.process_start_s, **report.startup}, lora_adapters=report.lora_adapters,
            healthy=self.engine.dead_error is None, time=time.time(),
        )

    def make_request(self, message: SubmitRequest | dict) -> Request:
        return request_for(self.engine, message)

    def refusal(self, exc: Exception) -> ReplicaError:
        """A pydantic error names its first field; an engine error carries the field it names."""
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            return ReplicaError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}", str(first["loc"][0]))
        return ReplicaError(str(exc), getattr(exc, "field", None))

    def error_chunk(self, exc: Exception, request_id: str = "") -> Chunk:
        return Chunk(self.replica_id, request_id, error=self.refusal(exc))

    def chunk(self, output: RequestOutput) -> Chunk:
        completion = output.outputs[0]
        return Chunk(
            self.replica_id, output.request_id, completion.delta_text, completion.delta_token_ids,
            completion.logprobs[-len(completion.delta_token_ids):] if completion.logprobs else None,
            completion.finish_reason, len(output.prompt_token_ids), len(completion.token_ids),
            output.num_cached_tokens, prompt_logprobs=output.prompt_logprobs,
        )

    async def submit(self, message: SubmitRequest | dict, channel: str,
                     target_replica: str | None = None) -> SubmitReply:
        """Queue a request whose chunks go out on `channel` (see `outputs`). Answers which replica took it, or
        why it refused it (so the router can answer 400 before any byte is sent). With a `continuation` it
        continues a stream whose replica died."""
        try:
            message = SubmitRequest.model_validate(message)
            if message.lora is None:
                req = self.make_request(message)
            elif (req := await self.preparing.prepare(message.request_id, lambda: self.make_request(message))) is None:
                return SubmitReply(self.replica_id)  # the router gave up on it while its adapter was read
            go_on = message.continuation
            start = (lambda engine: engine.add_continued(req, go_on.output_token_ids, go_on.emitted_chars)) \
                if go_on else None
            self._channel(channel).add(req, start)
        except (InvalidRequestError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            return SubmitReply(self.replica_id, self.refusal(exc))
        return SubmitReply(self.replica_id)

    def check_adapter(self, lora: LoRARequest) -> ReplicaError | None:
        """Load a LoRA adapter (POST /v1/load_lora_adapter): None, or why this base model cannot serve it."""
        try:
            self.engine.load_adapter(lora)
        except InvalidRequestError as exc:
            return self.refusal(exc)
        return None

    async def outputs(self, channel: str, target_replica: str | None = None, caller: ActorName | None = None,
                      socket: bool = False) -> AsyncIterator[StepChunks]:
        """The chunks of every request submitted on `channel`, a step's worth per item: one Ray message per
        engine step instead of one per running request. The first item, at once, names this replica; a
        request's chunks carry its `request_id`. Closing the stream aborts the requests still on it, and so does
        the end of `caller` (the router reading it), checked every CALLER_CHECK_S. With `socket` the first item
        carries the address of this replica's output socket, the steps go out there (replicas/output_socket.py),
        and the stream stays open without items as the channel's lease, until either side ends it."""
        lease = self.output_server.lease(channel) if socket else None  # before the router can connect
        address = await self.socket_address(lease) if lease is not None else None
        try:
            yield StepChunks(self.replica_id, address=address)
            if target_replica not in (None, self.replica_id):
                return  # Serve routed it here because the target is gone: the router learns that from the first item
            if address is None:
                async for step in self.steps(channel, caller):
                    yield step
                return
            while not await ended_within(lease.ended, CALLER_CHECK_S) and await self.reader_lives(channel, caller):
                pass
        finally:
            if lease is not None:
                self.output_server.release(lease)

    async def socket_address(self, lease: Lease) -> OutputAddress | None:
        """Where `lease`'s channel connects, or None (its steps then go on the Ray stream): where Ray runs with TLS
        (the socket is in clear) or this replica cannot listen."""
        if ray_uses_tls():
            return None
        try:
            return await self.output_server.address(lease)
        except OSError as exc:
            if not self.told_no_socket:
                logger.warning("replica %s: no output socket on %s (%r): its outputs go over Ray", self.replica_id,
                               self.output_server.host, exc)
                self.told_no_socket = True
            return None

    async def reader_lives(self, channel: str, caller: ActorName | None) -> bool:
        if caller is None or await asyncio.to_thread(caller.alive):
            return True
        logger.warning("channel %s: its router %s is gone; its requests end", channel, caller.name)
        return False

    async def steps(self, channel: str, caller: ActorName | None = None) -> AsyncIterator[StepChunks]:
        """`channel`'s steps, whichever way they go out, until `caller` (if given) is gone; closing it aborts the
        requests still on the channel."""
        batches = self._channel(channel)
        waiting: asyncio.Future | None = None
        checked = time.monotonic()
        try:
            while True:
                waiting = waiting or asyncio.ensure_future(batches.next_batch())
                if (await asyncio.wait({waiting}, timeout=CALLER_CHECK_S))[0]:
                    outputs, waiting = waiting.result(), None
                    yield StepChunks(self.replica_id, [self.chunk(o) if isinstance(o, RequestOutput)
                                                       else self.error_chunk(o.error, o.request_id) for o in outputs])
                if caller is not None and time.monotonic() - checked >= CALLER_CHECK_S:
                    if not await self.reader_lives(channel, caller):
                        return
                    checked = time.monotonic()
        finally:
            if waiting is not None:
                waiting.cancel()
            if self.channels.get(channel) is batches:
                del self.channels[channel]
            batches.close()

    def _channel(self, channel: str) -> OutputBatches:
        from kvloom.engine.async_engine import OutputBatches

        if channel not in self.channels:
            self.channels[channel] = OutputBatches(self.engine)
        return self.channels[channel]

    async def abort(self, request_id: str, target_replica: str | None = None) -> None:
        """The router gave up on a request it submitted: its channel aborts it (if it still runs), or it is dropped
        once made (if its adapter is being read)."""
        self.preparing.abort(request_id)
        for batches in self.channels.values():
            batches.forget(request_id)

    def replica_ready(self) -> str:
        """Answers once this replica runs: the router's call that waits in Serve's handle while none does is
        what Serve scales a deployment up from zero on (router/cold_start.py)."""
        return self.replica_id

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        self.engine.check_health()
