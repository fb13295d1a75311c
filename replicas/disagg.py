"""Prefill and decode replicas for disaggregated serving.

The router sends a new request to a PrefillReplica, which computes the prompt's KV and the first token (streamed
to the client at once) and parks the blocks. A DecodeReplica chosen by load reserves blocks (waiting while its pool
or batch is full: backpressure delays a hand-off, it never fails it), receives the KV over the configured
transport, acknowledges, and decodes the rest. A hand-off that fails (its peer died, the channel broke) costs the
request nothing: the decode replica computes the prompt and the output the client has itself, as failover does,
and streams on. The prefill side frees (or keeps as prefix cache) its blocks only after the acknowledgement; a
cancelled hand-off frees both sides. The KV transports (torch) are imported inside the actors, as the engine is
(see engine_replica.py).
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import TYPE_CHECKING

import ray

from kvloom.engine.errors import InvalidRequestError
from kvloom.replicas.engine_replica import EngineReplica
from kvloom.replicas.messages import Chunk, Handoff, ReplicaStats, SubmitRequest

if TYPE_CHECKING:
    from kvloom.replicas.kv_transfer import SendLane

logger = logging.getLogger(__name__)
RESERVE_POLL_S = 0.01


class PrefillReplica(EngineReplica):
    role = "prefill"

    async def __init__(self, *args, transfer_timeout_s: float = 30.0, **kwargs) -> None:
        await super().__init__(*args, **kwargs)
        self.transfer_timeout_s = transfer_timeout_s
        self.loop = asyncio.get_running_loop()
        self.send_lanes: dict[str, SendLane] = {}  # torch_distributed: one per decode replica
        # object-store hand-offs: this replica owns each payload and holds it until the router releases the
        # request (the decode side has the KV); a ref held only by borrowers was freed under a decode replica
        # still fetching it once (ReferenceCountingAssertionError, a clean-clone CI run)
        self.exports: dict[str, tuple[dict, ray.ObjectRef]] = {}

    async def prefill(self, message: SubmitRequest, target_replica: str | None = None) -> Chunk:
        """First token of a request; a `handoff` in the chunk means "decode the rest elsewhere"."""
        try:
            req = self.make_request(message)
        except (InvalidRequestError, ValueError) as exc:
            return self.error_chunk(exc)
        wanted = req.sampling_params.max_tokens
        req.sampling_params = req.sampling_params.model_copy(update={"max_tokens": 1})
        req.park_kv = wanted > 1
        async for output in self.engine.generate_request(req):
            last = output
        chunk = self.chunk(last)
        if req.park_kv and chunk.finish_reason == "length":
            if self.engine.is_parked(last.request_id):
                chunk.finish_reason = None
                chunk.handoff = Handoff(self.replica_id, len(req.prompt_token_ids))
        elif req.park_kv:  # finished for real (EOS, stop): nothing to hand off
            await self.release(req.request_id)
        return chunk

    def _check_target(self, target_replica: str | None) -> None:
        """Serve sends a call for a replica that is gone to another: the KV it asks about died with that one."""
        from kvloom.engine.kv_handoff import KVTransferError

        if target_replica not in (None, self.replica_id):
            raise KVTransferError(f"replica {target_replica} is gone, and its KV with it")

    async def export_kv(self, request_id: str, target_replica: str | None = None) -> dict:
        """Object-store transport: the payload goes into Ray's object store (wrapped, not resolved)."""
        from kvloom.engine.kv_handoff import export_kv

        self._check_target(target_replica)
        if request_id not in self.exports:
            header, payload = await self.engine.run_on_engine(lambda engine: export_kv(engine, request_id))
            self.exports[request_id] = (asdict(header), ray.put(payload))
        header, ref = self.exports[request_id]
        return {"header": header, "payload": [ref]}

    def pair_with(self, decode_replica: str, store_address: str, target_replica: str | None = None) -> None:
        """torch.distributed transport: serve `decode_replica`'s ready notices (a lane that ended is started again)."""
        from kvloom.replicas.kv_transfer import SendLane

        self._check_target(target_replica)
        lane = self.send_lanes.get(decode_replica)
        if lane is None or not lane.alive:
            self.send_lanes[decode_replica] = SendLane(self.replica_id, decode_replica, store_address,
                                                       self.engine.device, self.transfer_timeout_s, self._export)

    def _export(self, request_ids: list[str]) -> list:
        """The parked KV of these requests, copied out on the engine's thread (called from a send lane's)."""
        from kvloom.engine.kv_handoff import export_parked

        exporting = self.engine.run_on_engine(lambda engine: [export_parked(engine, r) for r in request_ids])
        return asyncio.run_coroutine_threadsafe(exporting, self.loop).result()

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        self.exports.pop(request_id, None)
        return await self.engine.run_on_engine(lambda engine: engine.release_parked(request_id))


class DecodeReplica(EngineReplica):
    role = "decode"

    async def __init__(self, *args, transfer_timeout_s: float = 30.0, **kwargs) -> None:
        from kvloom.replicas.kv_transfer import ReceiveLanes

        # set before the stats pushes start: hand-offs received (their bytes, and seconds from blocks reserved to
        # KV in hand) and those computed here instead
        self.handoffs = {"received": 0, "computed_here": 0, "bytes": 0, "transfer_s": 0.0}
        await super().__init__(*args, **kwargs)
        self.lanes = ReceiveLanes(self.replica_id, self.engine.device, transfer_timeout_s)

    def stats(self) -> ReplicaStats:
        lanes = getattr(self, "lanes", None)  # the first push may come before the constructor ends
        return dataclasses.replace(super().stats(), kv_store=lanes.address if lanes else None,
                                   handoffs=dict(self.handoffs))

    async def _receive(self, transfer: dict, request_id: str, prompt_len: int):
        from kvloom.engine.kv_handoff import KVHeader, KVTransferError

        local = self.engine.kv_header(prompt_len)
        if transfer["transport"] == "object_store":
            header = KVHeader(**transfer["header"])
            header.check_matches(local)
            try:
                payload = await transfer["payload"][0]
            except ray.exceptions.RayError as exc:  # its owner, the prefill replica, died
                raise KVTransferError(f"the KV of {request_id} is lost: {type(exc).__name__}") from exc
        else:
            header, payload = await self.lanes.receive(transfer["prefill_replica"], request_id, local)
        if header.num_tokens != prompt_len:
            raise KVTransferError(f"KV covers {header.num_tokens} tokens, the prompt has {prompt_len}")
        return payload

    async def decode(self, message: SubmitRequest, transfer: dict | None,
                     target_replica: str | None = None) -> AsyncIterator[Chunk]:
        """Go on from the output the client has (`message.continuation`): reserve blocks, receive the prompt's KV,
        acknowledge (`kv_received`), then stream the rest. With no `transfer`, or one that fails, the prompt and
        that output are computed here first."""
        from kvloom.engine.kv_handoff import KVTransferError, activate_kv, reserve_kv

        try:
            req = self.make_request(message)
        except (InvalidRequestError, ValueError) as exc:
            yield self.error_chunk(exc)
            return
        have = message.continuation
        payload = None
        if transfer is not None:
            while not await self.engine.run_on_engine(lambda engine: reserve_kv(engine, req)):
                await asyncio.sleep(RESERVE_POLL_S)  # backpressure: the transfer waits, nothing dropped
            reserved = time.monotonic()
            try:
                payload = await self._receive(transfer, req.request_id, len(req.prompt_token_ids))
                self.handoffs["bytes"] += payload.numel() * payload.element_size()
                self.handoffs["transfer_s"] += time.monotonic() - reserved
            except KVTransferError as exc:
                logger.warning("request %s: %s; its prompt is computed here instead", req.request_id, exc)
            finally:
                if payload is None:  # failed or cancelled: the reserved blocks go back
                    await self.engine.run_on_engine(lambda engine: engine.release_parked(req.request_id))
            yield Chunk(self.replica_id, req.request_id, kv_received=True)
        self.handoffs["received" if payload is not None else "computed_here"] += 1
        if payload is not None:
            start = lambda engine: activate_kv(engine, req, have.output_token_ids[0], payload)  # noqa: E731
        else:
            start = lambda engine: engine.add_continued(req, have.output_token_ids, have.emitted_chars)  # noqa: E731
        async for output in self.engine.generate_request(req, start):
            yield self.chunk(output)
