"""A Serve RequestRouter that honours the kvloom router's replica choice, and tells it which replicas Serve
routes to.

Serve's handle still owns the transport (and replica lifecycle); the kvloom router decides
where each request goes and passes `target_replica`. If that replica is gone or full, Serve
falls back to the others, least queued first. Each update of the replicas Serve routes to is published in
`router/serving_replicas.py`.
"""

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class TargetedRequestRouter(RequestRouter):
    deployment = ""  # whose replicas these are (set by Serve through `initialize_state`)

    def initialize_state(self, deployment: str = "", **kwargs) -> None:
        """Serve passes `request_router_kwargs` (cluster/app.py names the deployment)."""
        self.deployment = deployment

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # imported here, not at module level: Serve ships this class by value, with copies of its module's
        # globals, so only an import at call time reaches the process's own registry
        from kvloom.router.serving_replicas import SERVING

        super().update_replicas(replicas)
        if self.deployment:
            SERVING.publish(self.deployment, frozenset(r.replica_id.unique_id for r in replicas))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("target_replica") if pending_request else None
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != target]
        return [chosen, others] if chosen else [others]
