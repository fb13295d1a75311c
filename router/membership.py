"""The router follows Serve's own view of which replicas serve: replicas come in and leave without losing a
request.

Serve's controller broadcasts the replicas it routes to (router/request_router.py publishes the set).
- A replica that reports its stats before Serve routes to it (it is still starting) takes no request yet:
  Serve would send the request to another replica behind the router's back.
- A replica that leaves the set is being stopped (a scale-down, a replacement). Serve waits for its ongoing
  calls before it ends the process, up to the deployment's graceful shutdown timeout, but kvloom's requests do
  not show up there as calls of their own (they stream back over one channel per router, router/channels.py),
  so the router acts for them: the replica gets no new request and leaves the routing table (its prefix-cache
  entries with it), its running requests have `grace_s` to finish, and those still running then move to other
  replicas with the mid-stream continuation the dispatcher already has (the client's stream goes on; greedy
  and seeded text are what an uninterrupted run gives). Closing the channel ends the replica's last ongoing
  call, so Serve stops it without waiting out its timeout.
"""
import asyncio
import logging
import time

from kvloom.router.channels import ReplicaChannels, ReplicaLeft
from kvloom.router.replica_table import ReplicaTable
from kvloom.router.serving_replicas import SERVING

logger = logging.getLogger(__name__)
FINISH_POLL_S = 0.1


class ReplicaMembership:
    def __init__(self, deployment: str, table: ReplicaTable, channels: ReplicaChannels, grace_s: float) -> None:
        self.deployment, self.table, self.channels, self.grace_s = deployment, table, channels, grace_s
        self.served: set[str] = set()  # replicas seen in Serve's set (a starting one is not in it yet)
        self.leaving: dict[str, asyncio.Task] = {}

    def check(self) -> None:
        """Follow the set of replicas Serve routes to (called on every stats push): only those take requests,
        and one that leaves it is retired."""
        serving = SERVING.of(self.deployment)
        if serving is None:
            return
        self.table.serving = serving
        for replica_id in self.served - serving:
            if replica_id in self.table.replicas and replica_id not in self.leaving:
                self.table.retire(replica_id)
                self.leaving[replica_id] = asyncio.get_running_loop().create_task(self._let_go(replica_id))
        self.served = set(serving)

    async def _let_go(self, replica_id: str) -> None:
        running = self.channels.running_on(replica_id)
        logger.info("replica %s is leaving: %d request(s) running there get %g s to finish", replica_id, running,
                    self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while self.channels.running_on(replica_id) and time.monotonic() < deadline:
            await asyncio.sleep(FINISH_POLL_S)
        moved = self.channels.running_on(replica_id)
        if moved:
            logger.info("replica %s left: %d request(s) move to other replicas", replica_id, moved)
        self.channels.close(replica_id, ReplicaLeft(f"replica {replica_id} left (Serve stopped it)"))
        del self.leaving[replica_id]
