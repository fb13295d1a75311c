"""The router's admission queue: requests wait here, in policy order, until a replica has credit."""

import asyncio
from collections import deque
from dataclasses import dataclass, field

from kvloom.router.errors import APIError
from kvloom.router.replica_table import ReplicaState, ReplicaTable


@dataclass
class Ticket:
    request_id: str
    prompt_hashes: list[int]
    tenant: str = "default"
    priority: int = 0
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    def __init__(self, table: ReplicaTable, max_queued: int) -> None:
        self.table = table
        self.max_queued = max_queued
        self._queue: deque[Ticket] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    async def acquire(self, ticket: Ticket, front: bool = False) -> ReplicaState:
        """Wait for a replica with credit; a retried request (front=True) skips the line."""
        if len(self._queue) >= self.max_queued and not front:
            raise APIError(503, f"server overloaded: {len(self._queue)} requests queued", code="overloaded")
        ticket.future = asyncio.get_running_loop().create_future()
        (self._queue.appendleft if front else self._queue.append)(ticket)
        self.pump()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket in self._queue:
                self._queue.remove(ticket)
            elif ticket.future.done() and not ticket.future.cancelled():
                self.release(ticket.future.result())
            raise

    def release(self, replica: ReplicaState) -> None:
        self.table.give_back(replica)
        self.pump()

    def pump(self) -> None:
        """Hand out credit in queue order while there is any."""
        while self._queue:
            ticket = self._queue[0]
            replica = self.table.choose(ticket.prompt_hashes)
            if replica is None:
                return
            self._queue.popleft()
            self.table.take(replica, ticket.prompt_hashes)
            ticket.future.set_result(replica)
