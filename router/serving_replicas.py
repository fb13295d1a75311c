"""Which replicas Serve routes to, per deployment, as its controller last broadcast them to this process's
handles (`router/request_router.py` writes it, `router/membership.py` reads it).

A replica Serve chose to stop (a scale-down, a replacement) leaves this set at once, long before its process
ends, which is how the router learns that it is leaving.
"""


class ServingReplicas:
    """Deployment name -> replica ids (None: not heard yet). Written by the handles' request routers (their own
    thread), read by the router's loop: each value is replaced whole, never changed in place."""

    def __init__(self) -> None:
        self._ids: dict[str, frozenset[str]] = {}

    def publish(self, deployment: str, replica_ids: frozenset[str]) -> None:
        self._ids[deployment] = replica_ids

    def of(self, deployment: str) -> frozenset[str] | None:
        return self._ids.get(deployment)


SERVING = ServingReplicas()
