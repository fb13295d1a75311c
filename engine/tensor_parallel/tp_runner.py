"""Rank 0 of a tensor-parallel replica: the engine's runner, broadcasting each step's plan to the other ranks.

The scheduler, the block pool and sampling stay here; every rank (this one too) runs the same forward over its
shard, the LM head's vocabulary slices are gathered here, and only here are tokens sampled. Workers start as
local processes (`LocalWorkers`: offline engines, tests) or as Ray actors in the replica's placement group
(`replicas/tp_workers.py`), through the same `WorkerSpec`. A worker that dies shows at once in `check_health`,
and any collective it leaves unfinished fails within the group's timeout, naming the rank and the step.
"""

import logging
import multiprocessing
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.runner import ModelRunner
from kvloom.engine.step_plan import Op, StepInputs, control_header
from kvloom.engine.tensor_parallel.tp_group import TensorParallelError, TensorParallelGroup, open_store, wait_for_arrivals
from kvloom.engine.tensor_parallel.tp_shards import RankShard, plan_shards
from kvloom.engine.tensor_parallel.tp_worker import WorkerSpec, held_bytes, rank_runner_args, run_worker
from kvloom.kernels.item_pool import intra_op_threads, set_intra_op_threads

logger = logging.getLogger(__name__)


class Workers(Protocol):
    hint: str  # what most likely kills a worker before it reaches the rendezvous, for the error that says so

    def dead(self) -> str | None: ...  # which worker died, if one did
    def placements(self) -> list[str]: ...  # where each rank runs, rank 0 (this process) first
    def stop(self) -> None: ...


class LocalWorkers:
    """Ranks 1..N-1 as spawned processes of this one (daemons: they end with it)."""

    hint = ("each rank starts as a spawned process that imports the main script again, so a script that builds "
            "an engine with tensor_parallel_size > 1 needs an `if __name__ == \"__main__\":` guard around that "
            "code (without one the rank dies in that import; its error is on stderr above)")

    def __init__(self, specs: list[WorkerSpec]) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=run_worker, args=(spec,), name=f"kvloom-tp-rank{spec.rank}",
                                          daemon=True) for spec in specs]
        for process in self.processes:
            process.start()

    def dead(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def placements(self) -> list[str]:
        return [f"this process ({os.getpid()})", *(f"local process {process.pid}" for process in self.processes)]

    def stop(self) -> None:
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()


@dataclass(frozen=True)
class RankReport:
    """What one rank holds, as it measured it (its tensors' bytes)."""

    shard: RankShard
    placement: str
    weight_bytes: int
    kv_bytes: int


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, group: TensorParallelGroup, workers: Workers, num_threads: int) -> None:
        super().__init__(*args)
        self.group = group
        self.workers = workers
        self.num_threads = num_threads  # each rank's
        self.reports: list[RankReport] = []
        self._lock = threading.Lock()  # one plan on the wire at a time (the step loop and the keep-alive)
        self._last_plan = time.monotonic()
        self._stopped = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="kvloom-tp-keepalive", daemon=True)

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        with self._lock:
            self.group.step += 1
            self._send(*inputs.encode())
            return super().forward(inputs)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            body = torch.tensor([s for s, _ in copies] + [t for _, t in copies], dtype=torch.int64)
            with self._lock:
                self._send(control_header(Op.COPY_BLOCKS, len(body)), body)
                super().copy_blocks(copies)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Every rank's KV heads of these blocks, joined here (a KV hand-off leaves with all of them)."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        with self._lock:
            self._send(control_header(Op.EXPORT_KV, len(ids)), ids)
            return self.group.gather_heads(super().export_blocks(block_ids))

    def import_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Every KV head of these blocks arrives here; each rank keeps its own."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        with self._lock:
            self._send(control_header(Op.IMPORT_KV, len(ids)), ids)
            payload = self.group.broadcast(payload.to(self.group.device).contiguous(), "KV import")
            super().import_blocks(block_ids, self.group.own_heads(payload))

    def begin(self, reports: list[RankReport]) -> None:
        """Every rank has loaded (as `reports` say): plans may flow, and keep-alives while none do."""
        self.reports = reports
        self._keepalive.start()

    def check_health(self) -> None:
        dead = self.workers.dead()
        if dead is not None:
            raise TensorParallelError(f"{dead}; this replica cannot step any more")

    def shutdown(self) -> None:
        """Tell the workers to stop (when they can still hear it) and wait for them; once."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            try:
                self._send(control_header(Op.STOP))
            except TensorParallelError as exc:
                logger.warning("stopping tensor-parallel workers: %s", exc)
        self.workers.stop()

    def _send(self, header: torch.Tensor, body: torch.Tensor | None = None) -> None:
        self.group.broadcast(header.to(self.group.device), "step plan header")
        if body is not None and len(body):
            self.group.broadcast(body.to(self.group.device), "step plan")
        self._last_plan = time.monotonic()

    def _keep_alive(self) -> None:
        """Idle workers wait in a broadcast bounded by the group's timeout: a plan at least every third of it."""
        interval = self.group.timeout_s / 3
        while not self._stopped.wait(interval / 4):
            if time.monotonic() - self._last_plan < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                self._send(control_header(Op.KEEPALIVE))
            except TensorParallelError as exc:  # the step loop meets it too, at its next step
                logger.error("tensor-parallel keep-alive: %s", exc)
                return
            finally:
                self._lock.release()


def local_device(device: torch.device, rank: int) -> str:
    """Rank `rank`'s device on this host: the CPU, or the rank-th GPU."""
    return "cpu" if device.type == "cpu" else f"cuda:{rank}"


def start_tensor_parallel(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          kv_dtype: torch.dtype, device: torch.device, num_blocks: int,
                          launch: Callable[[list[WorkerSpec]], Workers] = LocalWorkers,
                          store_host: str = "127.0.0.1", worker_device: Callable[[int], str] | None = None,
                          num_threads: int | None = None) -> TensorParallelRunner:
    """Start ranks 1..N-1 (`launch`), join them as rank 0, load this rank's shard and collect every rank's report.

    Local ranks share this host's cores: unless given, each (this one too) gets an even share of this thread's
    torch threads.
    """
    world = config.tensor_parallel_size
    num_threads = num_threads or max(1, intra_op_threads() // world)
    worker_device = worker_device or (lambda rank: local_device(device, rank))
    store = open_store(store_host, 0, is_master=True, timeout_s=config.distributed_timeout_s)
    name = uuid.uuid4().hex

    def spec(rank: int) -> WorkerSpec:
        return WorkerSpec(config, rank, world, store_host, store.port, name, num_blocks, dtype, kv_dtype,
                          worker_device(rank), num_threads)

    workers = launch([spec(rank) for rank in range(1, world)])
    set_intra_op_threads(num_threads)
    shards = plan_shards(model_config, world)
    try:
        wait_for_arrivals(store, name, world, workers.dead, workers.hint, config.distributed_timeout_s)
        group = TensorParallelGroup(store, name, shards, 0, device, config.distributed_timeout_s)
        runner = TensorParallelRunner(*rank_runner_args(spec(0), group, model_config), group=group, workers=workers,
                                      num_threads=num_threads)
    except BaseException:
        workers.stop()
        raise
    held = group.gather_ints(held_bytes(runner))
    failed = [rank for rank, (weights, _) in enumerate(held) if weights < 0]
    if failed:
        runner.shutdown()
        raise ModelLoadError(f"tensor-parallel rank(s) {failed} could not load their shards (see their logs)")
    runner.begin([RankReport(shard, where, weights, kv) for shard, where, (weights, kv)
                  in zip(shards, workers.placements(), held)])
    return runner
