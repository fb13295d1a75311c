"""Adapter slots in the scheduler: which waiting requests may join the running batch, by their LoRA adapter.

A step computes at most `max_loras` adapters. A waiting request whose adapter runs joins it; one whose adapter does
not takes a free slot, or waits (without holding back the requests behind it). An adapter holds its slot while any
of its requests runs, so a steady stream of its own requests would keep it there for good, and a request for
another adapter would wait for ever. So once a request waits for a slot, the adapter that has held its own longest,
if for `tenure_s` or more, takes no request from behind that one in the queue: its slot frees as the requests it
runs finish, and the waiting one takes it. Requests ahead of the waiter in queue order join as before.
"""

import time
from collections.abc import Iterable

from kvloom.engine.request import Request


class AdapterAdmission:
    def __init__(self, max_loras: int | None, tenure_s: float) -> None:
        self.max_loras = max_loras  # None: no adapters served, every request joins
        self.tenure_s = tenure_s
        self.held_since: dict[str, float] = {}  # each running adapter: when it took its slot

    def start(self, running: Iterable[Request]) -> "AdmissionPass":
        """One pass over the queue in order, from the running batch's adapters."""
        now = time.monotonic()
        adapters = {r.lora.name for r in running if r.lora is not None}
        self.held_since = {name: self.held_since.get(name, now) for name in adapters}
        return AdmissionPass(self, now)


class AdmissionPass:
    def __init__(self, admission: AdapterAdmission, now: float) -> None:
        self.admission = admission
        self.now = now
        self.waiter_seen = False  # a request ahead in this pass waits for a slot

    def admits(self, adapter: str | None) -> bool:
        """Whether the next request in queue order, under `adapter` (None: the base model), may join."""
        held, max_loras = self.admission.held_since, self.admission.max_loras
        if adapter is None or max_loras is None:
            return True
        if adapter in held:
            return not self.waiter_seen or adapter != self._yielding()
        if len(held) < max_loras:
            return True
        self.waiter_seen = True
        return False

    def admitted(self, adapter: str | None) -> None:
        if adapter is not None:
            self.admission.held_since.setdefault(adapter, self.now)

    def _yielding(self) -> str | None:
        """The adapter giving its slot up: the one holding it longest, once for `tenure_s`."""
        held = self.admission.held_since
        oldest = min(held, key=held.__getitem__)
        return oldest if self.now - held[oldest] >= self.admission.tenure_s else None
