"""A request's place in the router's admission queue: what the queue policies rank it by."""

import asyncio
import time
from dataclasses import dataclass, field

from kvloom.router.tenants import ANONYMOUS


@dataclass(eq=False)  # identity: two requests are never the same ticket
class Ticket:
    request_id: str
    prompt_hashes: list[int]
    tenant: str = ANONYMOUS
    priority: int = 0  # class; lower runs first
    weight: float = 1.0  # the tenant's fair-share weight
    prompt_tokens: int = 0
    estimated_tokens: int = 0  # prompt + max_tokens: the job size SJF ranks by
    arrival: float = field(default_factory=time.monotonic)
    max_wait_s: float | None = None  # the tenant's max_queue_wait_s
    future: asyncio.Future | None = None  # resolves to the replica it may run on
    queued: bool = False
    dispatched: bool = False  # reached a replica at least once (its prompt was charged)
    credit_class: int = 0  # the class whose replica credit it holds while dispatched
    adapter: str | None = None  # its LoRA adapter: replicas holding it are preferred
    boosted: bool = False  # its tenant is within its share of the replica's slots while another is over
    yields_prefill: bool = False  # its tenant is over its share among those active there (engine/prefill_yield.py)

    @property
    def engine_priority(self) -> int:
        """The engine's ordering key: classes (as the policy ranks them) stay strict; within a class
        a boosted request goes before the others waiting in the engine and may preempt a running one."""
        return 2 * self.credit_class + (0 if self.boosted else 1)
