"""Requests that arrive while no replica runs (a deployment scaled to zero, or one whose replicas all failed)
wait in the router's queue while Serve starts one.

Serve's autoscaler scales a deployment up from zero on calls waiting in a handle for a replica; kvloom's
requests wait in the router's own queue instead, so the router keeps one call (`EngineReplica.replica_ready`)
waiting in the replicas' handle until a replica reports in. A request that has waited `timeout_s` with still
no replica ends with 503 and Retry-After. How long each cold start took is logged and exported
(`kvloom_cold_start_seconds`) as the first replica reports, before any queued request reaches it.
"""

import asyncio
import logging
import time

from kvloom.router.admission import AdmissionQueue
from kvloom.router.errors import APIError
from kvloom.router.replica_table import ReplicaTable

logger = logging.getLogger(__name__)
POLL_S = 0.1


class ColdStart:
    def __init__(self, replicas_handle, table: ReplicaTable, admission: AdmissionQueue, timeout_s: float,
                 observe=None) -> None:
        """`observe(seconds)` records each cold start's duration."""
        self.handle, self.table, self.admission, self.timeout_s = replicas_handle, table, admission, timeout_s
        self.observe = observe or (lambda seconds: None)
        self.started: float | None = None  # when the cold start under way began, if one is
        self.waiting: asyncio.Task | None = None  # holds the call Serve scales on; refuses requests waiting too long

    def notice(self) -> None:
        """A request is about to queue: with no replica live, make sure one is on its way."""
        if self.started is None and not self.table.routable():
            self.started = time.monotonic()
            logger.info("no replica runs: a request waits while Serve starts one")
            self.waiting = asyncio.get_running_loop().create_task(self._wait_for_replica())

    def replica_reported(self) -> None:
        """A replica reported its stats: if it ends a cold start, record how long it took and stop waiting."""
        if self.started is None or not self.table.routable():
            return
        seconds = time.monotonic() - self.started
        logger.info("a replica is ready after %.1f s", seconds)
        self.observe(seconds)
        self.waiting.cancel()
        self.started, self.waiting = None, None

    async def _wait_for_replica(self) -> None:
        call = self.handle.replica_ready.remote()  # waits in Serve's handle queue, which Serve scales from zero on
        too_long = APIError(503, f"no replica was ready within {self.timeout_s:g} s (one is starting); retry later",
                            code="no_replicas", headers={"Retry-After": "5"})
        try:
            while True:  # until replica_reported() cancels it
                self.admission.refuse_queued(too_long, arrived_before=time.monotonic() - self.timeout_s)
                await asyncio.sleep(POLL_S)
        finally:
            call.cancel()
