"""Admission-queue policies: which waiting request goes next when a replica has credit.

One small interface (push / peek / remove / len / iter). `fcfs` and `sjf` rank single tickets,
`fair` is VTC across tenants with FCFS within a tenant, and `priority` / `priority+fair` put
strict priority classes (optionally aged, so low classes are not starved forever) on top of
fcfs / fair within each class.
"""

import math
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvloom.router.ticket import Ticket
from kvloom.router.vtc import VirtualCounters

PolicyName = Literal["fcfs", "sjf", "priority", "fair", "priority+fair"]


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "priority+fair"
    priority_aging_s: float | None = Field(
        30.0, gt=0, description="a class waiting this long is served as one class better; null: strict classes")
    sjf_aging_tokens_per_s: float = Field(
        50.0, ge=0, description="sjf: each second of waiting takes this many tokens off a job's estimated size")
    vtc_input_weight: float = Field(1.0, ge=0, description="fair: weight of a prompt token")
    vtc_output_weight: float = Field(2.0, ge=0, description="fair: weight of a generated token")
    fair_share_preemption: bool = Field(
        True, description="fair: a tenant below its weighted share of a full replica's slots may preempt one over it")

    @property
    def ranks_priority(self) -> bool:
        return self.policy.startswith("priority")

    @property
    def preempts_for_share(self) -> bool:
        return self.fair_share_preemption and self.policy.endswith("fair")

    @property
    def engine_preempts(self) -> bool:
        """Whether replicas must run the engine's priority scheduler for this policy to work."""
        return self.ranks_priority or self.preempts_for_share


class QueuePolicy(Protocol):
    ranks_priority: bool

    def push(self, ticket: Ticket) -> None: ...
    def peek(self, now: float) -> Ticket: ...  # the next to dispatch; only called when not empty
    def remove(self, ticket: Ticket) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Ticket]: ...


class _TicketList:
    ranks_priority = False

    def __init__(self) -> None:
        self._tickets: list[Ticket] = []  # in arrival order

    def push(self, ticket: Ticket) -> None:
        self._tickets.append(ticket)

    def remove(self, ticket: Ticket) -> None:
        self._tickets.remove(ticket)

    def __len__(self) -> int:
        return len(self._tickets)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._tickets)


class FCFS(_TicketList):
    def peek(self, now: float) -> Ticket:
        return self._tickets[0]


class ShortestJobFirst(_TicketList):
    """Smallest prompt + max_tokens first; waiting shrinks the estimate so big jobs still run."""

    def __init__(self, aging_tokens_per_s: float) -> None:
        super().__init__()
        self.aging = aging_tokens_per_s

    def peek(self, now: float) -> Ticket:
        return min(self._tickets, key=lambda t: t.estimated_tokens - self.aging * (now - t.arrival))


class FairShare:
    """VTC: the backlogged tenant with the lowest virtual counter goes next (ties: fewer in flight,
    then the older head); FCFS within a tenant."""

    ranks_priority = False

    def __init__(self, counters: VirtualCounters) -> None:
        self.counters = counters
        self._queues: dict[str, deque[Ticket]] = {}

    def push(self, ticket: Ticket) -> None:
        self._queues.setdefault(ticket.tenant, deque()).append(ticket)

    def peek(self, now: float) -> Ticket:
        tenant = min(self._queues, key=lambda name: (*self.counters.rank(name), self._queues[name][0].arrival))
        return self._queues[tenant][0]

    def remove(self, ticket: Ticket) -> None:
        queue = self._queues[ticket.tenant]
        queue.remove(ticket)
        if not queue:
            del self._queues[ticket.tenant]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Ticket]:
        return chain.from_iterable(self._queues.values())


class PriorityClasses:
    """Strict classes (lower value first), each ordered by an inner policy.

    With aging, a class whose oldest ticket has waited k·aging_s competes as k classes better;
    ties go to the class whose oldest ticket is older, so an aged class does get its turn.
    """

    ranks_priority = True

    def __init__(self, make_inner: Callable[[], QueuePolicy], aging_s: float | None) -> None:
        self.make_inner = make_inner
        self.aging_s = aging_s
        self._classes: dict[int, QueuePolicy] = {}

    def push(self, ticket: Ticket) -> None:
        if ticket.priority not in self._classes:
            self._classes[ticket.priority] = self.make_inner()
        self._classes[ticket.priority].push(ticket)

    def _rank(self, priority: int, now: float) -> tuple[int, float]:
        oldest = min(t.arrival for t in self._classes[priority])
        lift = math.floor((now - oldest) / self.aging_s) if self.aging_s else 0
        return priority - lift, oldest

    def peek(self, now: float) -> Ticket:
        best = min(self._classes, key=lambda p: self._rank(p, now))
        return self._classes[best].peek(now)

    def remove(self, ticket: Ticket) -> None:
        inner = self._classes[ticket.priority]
        inner.remove(ticket)
        if not len(inner):
            del self._classes[ticket.priority]

    def __len__(self) -> int:
        return sum(len(c) for c in self._classes.values())

    def __iter__(self) -> Iterator[Ticket]:
        return chain.from_iterable(self._classes.values())


def make_policy(config: PolicyConfig, counters: VirtualCounters) -> QueuePolicy:
    aging = config.priority_aging_s
    return {
        "fcfs": FCFS,
        "sjf": lambda: ShortestJobFirst(config.sjf_aging_tokens_per_s),
        "fair": lambda: FairShare(counters),
        "priority": lambda: PriorityClasses(FCFS, aging),
        "priority+fair": lambda: PriorityClasses(lambda: FairShare(counters), aging),
    }[config.policy]()
