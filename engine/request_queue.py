"""Waiting-request queues, one per scheduling policy, behind the same small interface."""

import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol

from kvloom.engine.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._items.append(request)

    def add_front(self, request: Request) -> None:
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def priority_key(request: Request) -> tuple[int, float]:
    """Lower priority value first, then earlier arrival."""
    return (request.priority, request.arrival_time)


class PriorityQueue:
    """Heap on (priority, arrival); removal is lazy (an entry is live while `_live` names it)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, int] = {}  # request_id -> sequence number of its live entry
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        seq = next(self._counter)
        self._live[request.request_id] = seq
        heapq.heappush(self._heap, (*priority_key(request), seq, request))

    add_front = add  # a preempted request keeps its place by (priority, arrival)

    def _is_live(self, entry: tuple[int, float, int, Request]) -> bool:
        return self._live.get(entry[3].request_id) == entry[2]

    def peek(self) -> Request:
        while not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][3]

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        del self._live[request.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if self._is_live(entry))


def make_queue(policy: str) -> RequestQueue:
    return {"fcfs": FCFSQueue, "priority": PriorityQueue}[policy]()
