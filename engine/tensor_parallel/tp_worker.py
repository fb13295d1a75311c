"""A tensor-parallel worker: ranks 1..N-1 of a replica, each in its own process (a local process or a Ray actor).

It joins the replica's group, loads its shard of the weights and its share of every KV block, reports what it
holds, then runs whatever plan rank 0 broadcasts (steps, block copies) until told to stop. It owns no scheduler
and no requests: rank 0 decides everything. Rank 0 sends a keep-alive plan whenever it has been idle for a
third of the group's timeout, so a worker waiting for work never times out, while one whose driver died does.
"""

import logging
from dataclasses import dataclass

import torch

from kvloom.engine.config import EngineConfig
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.model.model_loader import load_shard_decoder
from kvloom.engine.runner import ModelRunner
from kvloom.engine.step_plan import HEADER_LEN, Op, StepInputs
from kvloom.engine.tensor_parallel.tp_group import TensorParallelGroup, announce_arrival, open_store
from kvloom.engine.tensor_parallel.tp_shards import plan_shards
from kvloom.kernels.backends import select_backend
from kvloom.kernels.item_pool import set_intra_op_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable (sent to a spawned process or a Ray actor)."""

    engine_config: EngineConfig
    rank: int
    world_size: int
    store_host: str
    store_port: int
    group_name: str
    num_blocks: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: str
    num_threads: int

    @property
    def timeout_s(self) -> float:
        return self.engine_config.distributed_timeout_s


def rank_runner_args(spec: WorkerSpec, group: TensorParallelGroup, model_config: ModelConfig) -> tuple:
    """A runner's arguments for this rank (rank 0 too): its decoder over its shard, its share of the KV pool."""
    config = spec.engine_config
    model_dir = resolve_model_dir(config.model)
    device = torch.device(spec.device)
    decoder = load_shard_decoder(model_dir, model_config, group.shard, group, spec.dtype, device)
    backend = select_backend(config.attention_backend, device)
    return (decoder, group.shard.local_config(model_config), backend, spec.num_blocks, config.block_size,
            spec.kv_dtype, device)


def held_bytes(runner: ModelRunner) -> list[int]:
    """[weight bytes, KV bytes] this rank holds."""
    kv = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    return [runner.decoder.weight_bytes(), kv]


def run_worker(spec: WorkerSpec) -> None:
    """A worker's whole life: join, load, report, then serve plans until STOP (or its group fails)."""
    set_intra_op_threads(spec.num_threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))  # NCCL maps each rank to its current device
    store = open_store(spec.store_host, spec.store_port, is_master=False, timeout_s=spec.timeout_s)
    announce_arrival(store, spec.group_name, spec.rank)
    model_config = ModelConfig.from_dir(resolve_model_dir(spec.engine_config.model))
    shards = plan_shards(model_config, spec.world_size)
    group = TensorParallelGroup(store, spec.group_name, shards, spec.rank, torch.device(spec.device), spec.timeout_s)
    try:
        runner = ModelRunner(*rank_runner_args(spec, group, model_config))
    except Exception:
        logger.exception("tensor-parallel rank %d could not load its shard", spec.rank)
        group.gather_ints([-1, -1])  # rank 0 raises, naming this rank
        return
    group.gather_ints(held_bytes(runner))
    serve_plans(group, runner)


@torch.inference_mode()
def serve_plans(group: TensorParallelGroup, runner: ModelRunner) -> None:
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=group.device)
    while True:
        fields = group.broadcast(header, "step plan header").tolist()
        op, body_len = fields[0], fields[-1]
        body = group.broadcast(torch.empty(body_len, dtype=torch.int64, device=group.device), "step plan") \
            if body_len else None
        if op == Op.STOP:
            return
        if op == Op.COPY_BLOCKS:
            pairs = body.view(2, -1).tolist()
            runner.copy_blocks(list(zip(*pairs)))
        elif op == Op.EXPORT_KV:
            group.gather_heads(runner.export_blocks(body.tolist()))
        elif op == Op.IMPORT_KV:
            local = runner.kv_caches[0][0]
            shape = (len(runner.kv_caches), 2, len(body), local.shape[1], group.num_kv_heads, local.shape[3])
            payload = group.broadcast(torch.empty(shape, dtype=local.dtype, device=group.device), "KV import")
            runner.import_blocks(body.tolist(), group.own_heads(payload))
        elif op == Op.STEP:
            group.step += 1
            runner.forward(StepInputs.decode(fields, body, group.device))
