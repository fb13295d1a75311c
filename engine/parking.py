"""Requests that hold KV blocks outside the scheduler for a disaggregated hand-off.

A prefill engine parks a finished prompt's blocks until the decode side has them (or gives up); a decode engine
reserves blocks for a prompt's KV before it arrives. Either way the blocks are the request's until `release`
(or, for a reserved decode, until `activate` hands it to the scheduler).
"""

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request


class ParkedKV:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._parked: dict[str, Request] = {}  # finished prefills holding KV until handed off
        self._reserved: dict[str, Request] = {}  # decodes holding blocks while their KV arrives

    def park(self, request: Request) -> None:
        self._parked[request.request_id] = request

    def parked(self, request_id: str) -> Request | None:
        return self._parked.get(request_id)

    def reserve(self, request: Request) -> None:
        self._reserved[request.request_id] = request

    def activate(self, request_id: str) -> Request:
        """A reserved decode's KV arrived: the request leaves the reserved set (the scheduler takes it)."""
        return self._reserved.pop(request_id)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def holds(self, request_id: str) -> bool:
        return request_id in self._parked or request_id in self._reserved

    def release(self, request_id: str) -> bool:
        """Free a hand-off's blocks: a parked prefill (sent, or given up) or a reserved decode."""
        request = self._parked.pop(request_id, None) or self._reserved.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        return request is not None
