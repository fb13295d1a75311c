"""Virtual token counters (VTC, Sheng et al., OSDI 2024): each tenant's weighted service so far.

A counter grows by `w_in·prompt tokens + w_out·generated tokens`, divided by the tenant's
weight, as that work is actually done (prompt at dispatch, output as it streams back). The fair
policy serves the backlogged tenant with the lowest counter. A tenant that becomes backlogged
again is lifted to the lowest counter among the backlogged tenants (or, when none is, to the
counter of the tenant that last left the queue), so idling banks no credit. The lift makes ties
common; they go to the tenant with fewer requests in flight, so a returning light tenant is not
made to wait behind one more request of the tenant it tied with.
"""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class VirtualCounters:
    input_weight: float = 1.0
    output_weight: float = 2.0
    values: dict[str, float] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=dict)  # queued tickets per backlogged tenant
    last_left: float = 0.0  # counter of the tenant that most recently stopped being backlogged
    inflight: Counter = field(default_factory=Counter)  # dispatched, not yet finished, per tenant

    def value(self, tenant: str) -> float:
        return self.values.get(tenant, 0.0)

    def enqueue(self, tenant: str) -> None:
        if tenant not in self.backlog:
            floor = min((self.value(t) for t in self.backlog), default=self.last_left)
            self.values[tenant] = max(self.value(tenant), floor)
            self.backlog[tenant] = 0
        self.backlog[tenant] += 1

    def dequeue(self, tenant: str) -> None:
        self.backlog[tenant] -= 1
        if not self.backlog[tenant]:
            del self.backlog[tenant]
            self.last_left = self.value(tenant)

    def rank(self, tenant: str) -> tuple[float, int]:
        return self.value(tenant), self.inflight[tenant]

    def started(self, tenant: str) -> None:
        self.inflight[tenant] += 1

    def finished(self, tenant: str) -> None:
        self.inflight[tenant] -= 1
        if self.inflight[tenant] <= 0:
            del self.inflight[tenant]

    def charge(self, tenant: str, weight: float, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = self.input_weight * prompt_tokens + self.output_weight * output_tokens
        self.values[tenant] = self.value(tenant) + cost / weight
