"""The LoRA adapters a deployment serves outlive its router process: adapters loaded and unloaded at run time are
recorded in a small named Ray actor of that deployment, so a router Serve restarts after a crash serves what the
one before it served, not only what the config names. A new deployment (`serve.run`, `kvloom serve`) starts from
its config and ends the ledgers of the ones before it.
"""

import ray

from kvloom.router.deployment_actors import deployment_actor

LEDGER_PREFIX = "kvloom-lora-ledger"


@ray.remote(num_cpus=0)
class AdapterLedger:
    def __init__(self) -> None:
        self.paths: dict[str, str] | None = None  # None: nothing changed at run time yet

    def record(self, paths: dict[str, str]) -> None:
        self.paths = dict(paths)

    def recorded(self) -> dict[str, str] | None:
        return self.paths


def open_ledger(app: str, deployment_id: str):
    """This deployment's ledger, ending those of the app's earlier deployments."""
    return deployment_actor(AdapterLedger, LEDGER_PREFIX, app, deployment_id)
