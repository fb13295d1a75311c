"""A Serve RequestRouter that honours the kvloom router's replica choice.

Serve's handle still owns the transport (and replica lifecycle); the kvloom router decides
where each request goes and passes `target_replica`. If that replica is gone or full, Serve
falls back to the others, least queued first.
"""

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class TargetedRequestRouter(RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("target_replica") if pending_request else None
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != target]
        return [chosen, others] if chosen else [others]
