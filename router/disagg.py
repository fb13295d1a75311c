"""Disaggregated serving, router side: prefill on one replica, decode on another.

`HandoffStream` looks to the dispatcher like one replica's stream: the first token comes from the prefill replica
(and reaches the client at once); then a decode replica chosen by load receives the KV (torch.distributed or the
object store), acknowledges, and streams the rest. The prefill replica frees its parked blocks only after that
acknowledgement; cancelling at any stage frees both sides.

Faults lose nothing. A prefill replica that fails before the first token raises like any replica (the dispatcher
retries the request). A hand-off that fails is absorbed by the decode replica, which computes the prompt itself
(replicas/disagg.py). A decode replica that dies is replaced by another (or by the one Serve starts in its place):
the KV is handed off again while the prefill replica still holds it, and otherwise the new decode replica goes on
from the output the client has, as the dispatcher's failover does for colocated replicas.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray.exceptions

from kvloom.replicas.messages import Chunk, Continuation, SubmitRequest
from kvloom.router.errors import APIError
from kvloom.router.replica_table import ReplicaState, ReplicaTable

logger = logging.getLogger(__name__)
DECODE_WAIT_S = 0.01


class DisaggStreams:
    resumable = False  # its streams go on after a decode replica's failure themselves (HandoffStream)

    def __init__(self, prefill_handle, decode_handle, decode_table: ReplicaTable, transport: str,
                 max_retries: int = 2, retry_wait_s: float = 60.0) -> None:
        self.prefill = prefill_handle
        self.decode = decode_handle
        self.decode_table = decode_table
        self.transport = transport
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s

    def open(self, message: SubmitRequest, prefill_replica: str) -> "HandoffStream":
        return HandoffStream(self, message, prefill_replica)

    async def take_decode_replica(self, wait_s: float) -> ReplicaState:
        """The least loaded decode replica with credit, waiting while all are full (at most `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while (replica := self.decode_table.choose([])) is None:
            if time.monotonic() > deadline:
                raise APIError(503, f"no decode replica took the request within {wait_s:g} s", code="replica_failed")
            await asyncio.sleep(DECODE_WAIT_S)
        self.decode_table.take(replica, [])
        return replica


class HandoffStream:
    def __init__(self, owner: DisaggStreams, message: SubmitRequest, prefill_replica: str) -> None:
        self.owner = owner
        self.message = message
        self.prefill_replica = prefill_replica
        self.request_id = message.request_id
        self._decode_response = None
        self._parked = False
        self._exported: dict | None = None  # object store: the KV's header and reference, once exported

    def cancel(self) -> None:
        if self._decode_response is not None:
            self._decode_response.cancel()
        self._release_prefill()

    def _release_prefill(self) -> None:
        if self._parked:
            self._parked = False
            self.owner.prefill.release.remote(self.request_id, target_replica=self.prefill_replica)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        owner = self.owner
        first = await owner.prefill.prefill.remote(self.message, target_replica=self.prefill_replica)
        handoff, first.handoff = first.handoff, None
        if handoff is not None:  # the KV is where the prefill ran (Serve sends a call for a dead replica elsewhere)
            self.prefill_replica, self._parked = handoff.prefill_replica, True
        yield first
        if handoff is None:
            return
        have_tokens, have_chars = list(first.token_ids), len(first.text)  # what the client has
        try:
            for attempt in range(owner.max_retries + 1):
                # the first decode replica may take a while to have room (backpressure); a replacement, retry_wait_s
                decode = await owner.take_decode_replica(owner.retry_wait_s if attempt else float("inf"))
                have = Continuation(output_token_ids=have_tokens, emitted_chars=have_chars)
                try:
                    async for chunk in self._decode(decode, have):
                        have_tokens += chunk.token_ids
                        have_chars += len(chunk.text)
                        yield chunk
                    return
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                    owner.decode_table.retire(decode.replica_id)  # no more hand-offs to it
                    logger.warning("request %s leaves decode replica %s after %d token(s): %r", self.request_id,
                                   decode.replica_id, len(have_tokens), exc)
                finally:
                    owner.decode_table.give_back(decode)
            raise APIError(500, f"decode replicas failed on each of {owner.max_retries + 1} attempts",
                           code="replica_failed")
        finally:
            self._release_prefill()

    async def _decode(self, decode: ReplicaState, have: Continuation) -> AsyncIterator[Chunk]:
        """One decode replica's part: from the KV the prefill replica holds, or (once it let go) from `have`."""
        owner = self.owner
        transfer = None
        if self._parked:
            try:
                transfer = await self._transfer(decode)
            except ray.exceptions.RayError as exc:
                self._parked = False  # the prefill replica died with the KV: the decode replica computes it
                logger.warning("request %s: its prefill replica %s is gone (%r)", self.request_id,
                               self.prefill_replica, exc)
        message = self.message.model_copy(update={"continuation": have})
        self._decode_response = owner.decode.options(stream=True).decode.remote(
            message, transfer, target_replica=decode.replica_id)
        async for chunk in self._decode_response:
            if chunk.kv_received:
                self._release_prefill()  # the decode side holds the KV now (or computes it itself)
                continue
            yield chunk

    async def _transfer(self, decode: ReplicaState) -> dict:
        owner = self.owner
        if owner.transport == "object_store":
            self._exported = self._exported or await owner.prefill.export_kv.remote(
                self.request_id, target_replica=self.prefill_replica)
            return {"transport": "object_store", **self._exported}
        await owner.prefill.pair_with.remote(decode.replica_id, decode.stats.kv_store,
                                             target_replica=self.prefill_replica)
        return {"transport": "torch_distributed", "prefill_replica": self.prefill_replica}
