"""The router's admission queue: requests wait here, in policy order, until a replica has credit.

The policy decides the order; this queue owns the mechanics around it: credit, retries (which
skip the line), the tenant's max queue wait, cancellation, fair-share preemption (see
replica_table), and the VTC counters that fair policies read (kept for every policy, so
switching policy on reload keeps service history).
"""

import asyncio
import time
from collections import deque

from kvloom.router.errors import APIError
from kvloom.router.policies import FCFS, QueuePolicy
from kvloom.router.replica_table import ReplicaState, ReplicaTable
from kvloom.router.ticket import Ticket
from kvloom.router.vtc import VirtualCounters

__all__ = ["AdmissionQueue", "Ticket"]


class AdmissionQueue:
    def __init__(self, table: ReplicaTable, max_queued: int, policy: QueuePolicy | None = None,
                 counters: VirtualCounters | None = None) -> None:
        self.table = table
        self.max_queued = max_queued
        self.policy = FCFS() if policy is None else policy  # (an empty policy is falsy)
        self.counters = VirtualCounters() if counters is None else counters
        self.fair_share_preemption = False
        self._retries: deque[Ticket] = deque()

    def __len__(self) -> int:
        return len(self.policy) + len(self._retries)

    def queued_up_to(self, priority: int | None) -> int:
        """Queued requests of this priority class or a better (lower) one; every queued request for None."""
        if priority is None:
            return len(self)
        return sum(ticket.priority <= priority for ticket in (*self.policy, *self._retries))

    def queued_by_tenant(self) -> dict[str, int]:
        return dict(self.counters.backlog)

    def set_policy(self, policy: QueuePolicy) -> None:
        """Switch policy in place; waiting requests keep their arrival order into the new one."""
        for ticket in sorted(self.policy, key=lambda t: t.arrival):
            policy.push(ticket)
        self.policy = policy
        self.pump()

    async def acquire(self, ticket: Ticket, front: bool = False) -> ReplicaState:
        """Wait for a replica with credit; a retried request (front=True) skips the line."""
        if len(self) >= self.max_queued and not front:
            raise APIError(503, f"server overloaded: {len(self)} requests queued", code="overloaded",
                           headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        ticket.future = loop.create_future()
        (self._retries.append if front else self.policy.push)(ticket)
        ticket.queued = True
        self.counters.enqueue(ticket.tenant)
        expiry = None
        if ticket.max_wait_s is not None and not front:
            delay = ticket.arrival + ticket.max_wait_s - time.monotonic()
            expiry = loop.call_later(max(0.0, delay), self._expire, ticket)
        self.pump()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket.queued:
                self._unqueue(ticket)
            elif ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                self.release(ticket.future.result(), ticket)
            raise
        finally:
            if expiry is not None:
                expiry.cancel()

    def release(self, replica: ReplicaState, ticket: Ticket | None = None) -> None:
        if ticket is None:
            self.table.give_back(replica)
        else:
            self.table.give_back(replica, ticket.credit_class, ticket.tenant)
            self.counters.finished(ticket.tenant)
        self.pump()

    def charge(self, ticket: Ticket, output_tokens: int) -> None:
        """Generated tokens streamed back: they advance the tenant's virtual counter."""
        self.counters.charge(ticket.tenant, ticket.weight, output_tokens=output_tokens)

    def refuse_queued(self, error: APIError, arrived_before: float | None = None) -> None:
        """Every waiting request (that arrived before `arrived_before`, a monotonic time) ends with `error`: the
        server stops before any replica could take them, or none came in time."""
        for ticket in [*self._retries, *self.policy]:
            if arrived_before is not None and ticket.arrival >= arrived_before:
                continue
            self._unqueue(ticket)
            if not ticket.future.done():
                ticket.future.set_exception(error)

    def _unqueue(self, ticket: Ticket) -> None:
        if ticket in self._retries:
            self._retries.remove(ticket)
        else:
            self.policy.remove(ticket)
        ticket.queued = False
        self.counters.dequeue(ticket.tenant)

    def _expire(self, ticket: Ticket) -> None:
        if not ticket.queued or ticket.future.done():
            return
        self._unqueue(ticket)
        waited = time.monotonic() - ticket.arrival
        ticket.future.set_exception(APIError(
            503, f"request waited {waited:.1f} s in the router queue, over tenant '{ticket.tenant}' "
                 f"max_queue_wait_s of {ticket.max_wait_s:g}; the server is saturated, retry later",
            None, "max_queue_wait_s", headers={"Retry-After": "1"}))

    def pump(self) -> None:
        """Hand out credit in policy order while the next request has any."""
        now = time.monotonic()
        while len(self):
            ticket = self._retries[0] if self._retries else self.policy.peek(now)
            if ticket.future.done():  # cancelled; its waiter has not run yet
                self._unqueue(ticket)
                continue
            credit_class = ticket.priority if self.policy.ranks_priority else 0
            replica = self.table.choose(ticket.prompt_hashes, credit_class, ticket.adapter)
            if replica is None and self.fair_share_preemption:
                replica = self.table.choose_below_share(ticket.tenant, ticket.weight)
            if replica is None:
                return
            ticket.boosted = (self.fair_share_preemption
                              and self.table.is_below_share(replica, ticket.tenant, ticket.weight))
            ticket.yields_prefill = self.table.crowds(replica, ticket.tenant, ticket.weight)
            self._unqueue(ticket)
            self.table.take(replica, ticket.prompt_hashes, credit_class, ticket.tenant, ticket.weight, ticket.adapter)
            self.counters.started(ticket.tenant)
            ticket.credit_class = credit_class
            if not ticket.dispatched:
                ticket.dispatched = True
                self.counters.charge(ticket.tenant, ticket.weight, prompt_tokens=ticket.prompt_tokens)
            ticket.future.set_result(replica)
