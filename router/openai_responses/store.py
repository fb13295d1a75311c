"""Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}` returns. They live in a
small named Ray actor of the deployment (as the LoRA ledger does, router/adapter_ledger.py), so they outlive a
router Serve restarts after a crash; a new deployment starts empty. Each belongs to the tenant that made it:
another tenant's id is unknown to it (a 404, never the content). Bounded: at most `max_count`, none older than
`max_age_s` (the oldest go first). A background response the router was generating when it stopped cannot be
finished by the next one: `fail_unfinished` marks it failed."""

import time
from collections import OrderedDict

import ray

from kvloom.router.deployment_actors import deployment_actor

STORE_PREFIX = "kvloom-responses"


@ray.remote(num_cpus=0)
class ResponseStore:
    def __init__(self, max_count: int, max_age_s: float) -> None:
        self.max_count, self.max_age_s = max_count, max_age_s
        self.entries: OrderedDict[str, tuple[str, float, dict]] = OrderedDict()  # id -> (tenant, stored at, record)

    def put(self, response_id: str, tenant: str, record: dict) -> None:
        """`record`: the response and the conversation's messages up to and including its output."""
        self.entries[response_id] = (tenant, time.monotonic(), record)
        self.entries.move_to_end(response_id)
        self._evict()

    def get(self, response_id: str, tenant: str) -> dict | None:
        self._evict()
        entry = self.entries.get(response_id)
        return entry[2] if entry is not None and entry[0] == tenant else None

    def delete(self, response_id: str, tenant: str) -> bool:
        entry = self.entries.get(response_id)
        if entry is None or entry[0] != tenant:
            return False
        del self.entries[response_id]
        return True

    def fail_unfinished(self, message: str) -> int:
        """Mark the responses still queued or in progress failed; how many there were."""
        unfinished = [record["response"] for _, _, record in self.entries.values()
                      if record["response"]["status"] in ("queued", "in_progress")]
        for response in unfinished:
            response.update(status="failed", error={"code": "server_error", "message": message})
        return len(unfinished)

    def count(self) -> int:
        return len(self.entries)

    def _evict(self) -> None:
        now = time.monotonic()
        while self.entries and (len(self.entries) > self.max_count
                                or now - next(iter(self.entries.values()))[1] > self.max_age_s):
            self.entries.popitem(last=False)


def open_store(app: str, deployment_id: str, max_count: int, max_age_s: float):
    """This deployment's store, ending those of the app's earlier deployments."""
    return deployment_actor(ResponseStore, STORE_PREFIX, app, deployment_id, max_count, max_age_s)
