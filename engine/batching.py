"""Batch formation strategies: which waiting requests may join the running batch this step.

All strategies run through the same scheduler, runner and kernels, so measured differences are
scheduling alone. Batch-level strategies (static, dynamic) count what they waste: padding tokens
(members padded to the batch's longest prompt, as a padded `generate` would compute) and idle
slot-steps (slots held by members that already finished while the batch runs on).
"""

import itertools
import time
from collections import defaultdict
from collections.abc import Iterator

from kvloom.engine.request import Request
from kvloom.engine.request_queue import RequestQueue


class ContinuousBatching:
    """Iteration-level: any waiting request joins as soon as a slot, blocks and budget allow."""

    padding_tokens = 0

    def admissible(self, waiting: RequestQueue) -> Iterator[Request]:
        """Queue order. The scheduler removes each request it admits before asking again, so the head comes next;
        one it passes over (its LoRA adapter waits for a slot) stays the head, and the rest follow from a snapshot."""
        while len(waiting):
            head = waiting.peek()
            yield head
            if len(waiting) and waiting.peek() is head:
                yield from list(waiting)[1:]
                return

    def on_finish(self, request: Request) -> None:
        pass

    def idle_slots(self) -> int:
        return 0


class StaticBatching:
    """A fixed batch admitted together; nobody joins until its longest member has finished."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.members: set[str] = set()
        self.batch_size = 0
        self.padding_tokens = 0

    def _form(self, waiting: RequestQueue) -> list[Request]:
        return list(itertools.islice(waiting, self.max_batch))

    def admissible(self, waiting: RequestQueue) -> Iterator[Request]:
        if not self.members:
            batch = self._form(waiting)
            self.members = {r.request_id for r in batch}
            self.batch_size = len(batch)
            longest = max((r.num_prompt_tokens for r in batch), default=0)
            self.padding_tokens += sum(longest - r.num_prompt_tokens for r in batch)
        return iter([r for r in waiting if r.request_id in self.members])

    def on_finish(self, request: Request) -> None:
        self.members.discard(request.request_id)

    def idle_slots(self) -> int:
        return self.batch_size - len(self.members) if self.members else 0


class DynamicBatching(StaticBatching):
    """Length-bucketed batches: a bucket starts when full or when its oldest waited `max_wait_s`."""

    def __init__(self, max_batch: int, bucket_width: int, max_wait_s: float) -> None:
        super().__init__(max_batch)
        self.bucket_width = bucket_width
        self.max_wait_s = max_wait_s

    def _form(self, waiting: RequestQueue) -> list[Request]:
        buckets: dict[int, list[Request]] = defaultdict(list)
        for request in waiting:
            buckets[request.num_prompt_tokens // self.bucket_width].append(request)
        now = time.monotonic()
        ready = [b for b in buckets.values()
                 if len(b) >= self.max_batch or now - b[0].arrival_time >= self.max_wait_s]
        if not ready:
            return []
        return min(ready, key=lambda b: b[0].arrival_time)[: self.max_batch]


def make_batching(strategy: str, max_batch: int, bucket_width: int, max_wait_s: float):
    if strategy == "continuous":
        return ContinuousBatching()
    if strategy == "static":
        return StaticBatching(max_batch)
    if strategy == "dynamic":
        return DynamicBatching(max_batch, bucket_width, max_wait_s)
    raise ValueError(f"batching must be static, dynamic or continuous, got {strategy!r}")
