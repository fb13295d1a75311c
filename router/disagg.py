"""Disaggregated serving, router side: prefill on one replica, decode on another.

`HandoffStream` looks to the dispatcher like one replica's stream: the first token comes from
the prefill replica (and reaches the client at once); then a decode replica chosen by load
receives the KV (torch.distributed or the object store), acknowledges, and streams the rest. The
prefill replica frees its parked blocks only after that acknowledgement; cancelling at any stage
frees both sides. A prefill replica that fails before the first token raises like any replica
(the dispatcher retries); a failure after it ends the request with a clear error.
"""

import asyncio
import itertools
from collections.abc import AsyncIterator

import ray.exceptions

from kvloom.replicas.messages import Chunk, SubmitRequest
from kvloom.router.replica_table import ReplicaState, ReplicaTable

DECODE_WAIT_S = 0.01


class DisaggStreams:
    resumable = False  # going on after a hand-off would need a prefill of prompt + output, then a new hand-off

    def __init__(self, prefill_handle, decode_handle, decode_table: ReplicaTable, transport: str) -> None:
        self.prefill = prefill_handle
        self.decode = decode_handle
        self.decode_table = decode_table
        self.transport = transport
        self._tags = itertools.count(1)

    def open(self, message: SubmitRequest, prefill_replica: str) -> "HandoffStream":
        return HandoffStream(self, message, prefill_replica)

    def next_tag(self) -> int:
        """A fresh tag for a torch.distributed KV transfer (a pair's transfers never share one)."""
        return next(self._tags)

    async def take_decode_replica(self) -> ReplicaState:
        """The least loaded decode replica with credit, waiting while all are full."""
        while (replica := self.decode_table.choose([])) is None:
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
        self._parked = handoff is not None
        yield first
        if handoff is None:
            return
        decode = await owner.take_decode_replica()
        try:
            async for chunk in self._decode(decode, first.token_ids[0]):
                yield chunk
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            owner.decode_table.drop(decode.replica_id)  # don't route more hand-offs to it
            raise
        finally:
            owner.decode_table.give_back(decode)
            self._release_prefill()

    async def _decode(self, decode: ReplicaState, first_token: int) -> AsyncIterator[Chunk]:
        owner = self.owner
        sending = None
        if owner.transport == "object_store":
            exported = await owner.prefill.export_kv.remote(self.request_id, target_replica=self.prefill_replica)
            transfer = {"transport": "object_store", **exported}
        else:
            tag = owner.next_tag()
            transfer = {"transport": "torch_distributed", "prefill_replica": self.prefill_replica, "tag": tag}
            sending = owner.prefill.send_kv.remote(self.request_id, decode.replica_id, decode.stats.kv_store, tag,
                                                   target_replica=self.prefill_replica)
        self._decode_response = owner.decode.options(stream=True).decode.remote(
            self.message, first_token, transfer, target_replica=decode.replica_id)
        async for chunk in self._decode_response:
            if chunk.kv_received:
                if sending is not None:
                    await sending
                self._release_prefill()  # the decode side holds the KV now
                continue
            yield chunk
