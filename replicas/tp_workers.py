"""Tensor-parallel ranks 1..N-1 of a Serve replica, as Ray actors in the replica's own placement group.

Serve creates one placement group per replica from the deployment's bundles (one per rank, STRICT_PACK by
default: the ranks' collectives stay inside a node) and starts the replica in bundle 0; each worker actor
takes the bundle of its rank. The workers are the replica's children, so Ray ends them with it when Serve
replaces it. `dead` polls each worker's run: a worker whose process died shows at once.
"""

import logging

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvloom.engine.cpu_threads import openmp_env
from kvloom.engine.tensor_parallel.tp_worker import WorkerSpec, run_worker

logger = logging.getLogger(__name__)


def placement() -> str:
    """Where this process runs, as `kvloom status` shows a rank."""
    return f"node {ray.get_runtime_context().get_node_id()[:12]} ({ray.util.get_node_ip_address()}), " \
           f"GPUs {ray.get_gpu_ids()}"


@ray.remote(max_restarts=0)
class TensorParallelWorker:
    def where(self) -> str:
        return placement()

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)


def ray_launch(device: str, num_cpus: float, num_gpus: float) -> dict:
    """`start_tensor_parallel`'s keywords for a Serve replica: each worker takes its rank's bundle
    (`num_cpus`, `num_gpus` each), meets rank 0 at this node's address and runs on `device` ("cuda": the GPU
    Ray gave it)."""
    return {"launch": lambda specs: RayWorkers(specs, num_cpus, num_gpus),
            "store_host": ray.util.get_node_ip_address(), "worker_device": lambda rank: device}


class RayWorkers:
    hint = "see the worker actor's log (Ray's worker logs on its node) for why it stopped"

    def __init__(self, specs: list[WorkerSpec], num_cpus: float, num_gpus: float) -> None:
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("a tensor-parallel replica needs its placement group (Serve's "
                               "placement_group_bundles): none is current")
        self.actors = [TensorParallelWorker.options(
            num_cpus=num_cpus, num_gpus=num_gpus, name=None, runtime_env={"env_vars": openmp_env()},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=spec.rank),
        ).remote() for spec in specs]
        self._placements = ray.get([actor.where.remote() for actor in self.actors])  # before `run`, which blocks
        self.runs = [actor.run.remote(spec) for actor, spec in zip(self.actors, specs)]

    def dead(self) -> str | None:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                ray.get(ref)
            except Exception as exc:
                return f"tensor-parallel rank {rank} died: {exc.__class__.__name__}"
            return f"tensor-parallel rank {rank} stopped"
        return None

    def placements(self) -> list[str]:
        return [placement(), *self._placements]

    def stop(self) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for actor in self.actors:
            ray.kill(actor)
