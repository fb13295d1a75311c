"""Requests whose preparation may read from disk (an adapter's first request reads its weights: tens of ms from the
page cache, seconds from a cold disk), prepared on a worker thread, so the replica's event loop meanwhile streams
every other request's chunks. A router's abort that arrives during the read is kept, and the request dropped once
it is made, rather than run to its end with no one reading it."""

import asyncio
from collections.abc import Callable
from typing import TypeVar

Made = TypeVar("Made")


class OffLoopPreparation:
    def __init__(self) -> None:
        self.aborted: dict[str, bool] = {}  # request id -> its abort came while it was being made

    async def prepare(self, request_id: str, make: Callable[[], Made]) -> Made | None:
        """make() on a worker thread (its exceptions raised here); None where `abort(request_id)` came meanwhile."""
        self.aborted[request_id] = False
        try:
            made = await asyncio.to_thread(make)
        finally:
            aborted = self.aborted.pop(request_id)
        return None if aborted else made

    def abort(self, request_id: str) -> None:
        if request_id in self.aborted:
            self.aborted[request_id] = True
