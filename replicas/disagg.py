"""Prefill and decode replicas for disaggregated serving.

The router sends a new request to a PrefillReplica, which computes the prompt's KV and the first
token (streamed to the client at once) and parks the blocks. A DecodeReplica chosen by load
reserves blocks (waiting while its pool or batch is full), receives the KV over the configured
transport, acknowledges, and decodes the rest. The prefill side frees (or keeps as prefix cache)
its blocks only after that acknowledgement; a cancelled or failed hand-off frees both sides.
The KV transports (torch) are imported inside the actors, as the engine is (see engine_replica.py).
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import asdict

import ray

from kvloom.engine.errors import InvalidRequestError
from kvloom.replicas.engine_replica import EngineReplica
from kvloom.replicas.messages import Chunk, Handoff, ReplicaStats, SubmitRequest

RESERVE_POLL_S = 0.01


class PrefillReplica(EngineReplica):
    role = "prefill"

    async def __init__(self, *args, **kwargs) -> None:
        from kvloom.replicas.kv_transfer import PairGroups

        await super().__init__(*args, **kwargs)
        self.pairs = PairGroups(self.replica_id, self.engine.device)
        # object-store hand-offs: this replica owns each payload and holds it until the router releases the
        # request (the decode side has the KV); a ref held only by borrowers was freed under a decode replica
        # still fetching it once (ReferenceCountingAssertionError, a clean-clone CI run)
        self.exports: dict[str, ray.ObjectRef] = {}

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

    async def export_kv(self, request_id: str, target_replica: str | None = None) -> dict:
        """Object-store transport: the payload goes into Ray's object store (wrapped, not resolved)."""
        from kvloom.engine.kv_handoff import export_kv

        header, payload = await self.engine.run_on_engine(lambda engine: export_kv(engine, request_id))
        self.exports[request_id] = ray.put(payload)
        return {"header": asdict(header), "payload": [self.exports[request_id]]}

    async def send_kv(self, request_id: str, decode_replica: str, store_address: str, tag: int,
                      target_replica: str | None = None) -> None:
        """torch.distributed transport: header then payload to the decode replica."""
        from kvloom.engine.kv_handoff import export_kv
        from kvloom.replicas.kv_transfer import send_kv

        header, payload = await self.engine.run_on_engine(lambda engine: export_kv(engine, request_id))
        group = await self.pairs.group(self.replica_id, decode_replica, store_address)
        try:
            await send_kv(group, tag, header, payload, decode_replica)
        except Exception:
            self.pairs.forget(decode_replica)
            raise

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        self.exports.pop(request_id, None)
        return await self.engine.run_on_engine(lambda engine: engine.release_parked(request_id))


class DecodeReplica(EngineReplica):
    role = "decode"

    async def __init__(self, *args, **kwargs) -> None:
        from kvloom.replicas.kv_transfer import PairGroups

        await super().__init__(*args, **kwargs)
        self.pairs = PairGroups(self.replica_id, self.engine.device)
        self.kv_store = self.pairs.host_store()

    def stats(self) -> ReplicaStats:
        return dataclasses.replace(super().stats(), kv_store=getattr(self, "kv_store", None))

    async def _receive(self, transfer: dict, prompt_len: int):
        from kvloom.engine.kv_handoff import KVHeader, KVTransferError
        from kvloom.replicas.kv_transfer import recv_header, recv_payload

        local = self.engine.kv_header(prompt_len)
        if transfer["transport"] == "object_store":
            header = KVHeader(**transfer["header"])
            header.check_matches(local)
            payload = await transfer["payload"][0]
        else:
            group = await self.pairs.group(transfer["prefill_replica"], self.replica_id, None)
            try:
                peer = transfer["prefill_replica"]
                header = await recv_header(group, transfer["tag"], self.engine.device, peer)
                header.check_matches(local)
                payload = await recv_payload(group, transfer["tag"], header, local.torch_dtype, self.engine.device,
                                             peer)
            except Exception:
                self.pairs.forget(transfer["prefill_replica"])
                raise
        if header.num_tokens != prompt_len:
            raise KVTransferError(f"KV covers {header.num_tokens} tokens, the prompt has {prompt_len}")
        return payload

    async def decode(self, message: SubmitRequest, first_token: int, transfer: dict,
                     target_replica: str | None = None) -> AsyncIterator[Chunk]:
        """Reserve blocks, receive the KV, acknowledge (`kv_received`), then stream the rest."""
        from kvloom.engine.kv_handoff import activate_kv, reserve_kv

        try:
            req = self.make_request(message)
        except (InvalidRequestError, ValueError) as exc:
            yield self.error_chunk(exc)
            return
        while not await self.engine.run_on_engine(lambda engine: reserve_kv(engine, req)):
            await asyncio.sleep(RESERVE_POLL_S)  # backpressure: the transfer waits, nothing dropped
        try:
            payload = await self._receive(transfer, len(req.prompt_token_ids))
        except BaseException:
            await self.engine.run_on_engine(lambda engine: engine.release_parked(req.request_id))
            raise
        yield Chunk(self.replica_id, req.request_id, kv_received=True)
        start = lambda engine: activate_kv(engine, req, first_token, payload)  # noqa: E731
        async for output in self.engine.generate_request(req, start):
            yield self.chunk(output)
