"""The collectives a tensor-parallel forward needs, on one rank, and their one-device stand-in.

The decoder calls `all_reduce` after each row-parallel GEMM (o_proj, down), `embed` for its vocabulary-parallel
lookup and `gather_logits` for its LM head; with one device these are the plain operations, so the decoder has
no tensor-parallel branches. The group is built straight on a TCPStore (no torch.distributed default group), so
several engines can live in one process. gloo on CPU, NCCL on CUDA, the same calls. Every collective has the
group's timeout, and a failure names the rank, the step and the operation: a dead peer ends in an error, never
a hang.
"""

import datetime
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvloom.engine.tensor_parallel.tp_shards import RankShard


class TensorParallelError(RuntimeError):
    """A collective of a tensor-parallel replica failed (a rank died, or timed out)."""


class SingleDevice:
    """The whole model on one device: nothing to reduce or gather."""

    rank = 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, table).float()

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def open_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The replica's rendezvous store: rank 0 hosts it (port 0: any free one), the others connect."""
    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def arrival_key(name: str, rank: int) -> str:
    return f"kvloom-tp/{name}/arrived/{rank}"


def announce_arrival(store: dist.TCPStore, name: str, rank: int) -> None:
    """A worker reached the rendezvous (its process started and imported kvloom): rank 0 may join the group."""
    store.set(arrival_key(name, rank), "1")


def wait_for_arrivals(store: dist.TCPStore, name: str, world_size: int, dead: Callable[[], str | None],
                      hint: str, timeout_s: float, poll_s: float = 0.05) -> None:
    """Rank 0, before joining the group: wait until every other rank has announced itself, failing at once,
    with `hint`, when one has died first. The group's own join would wait out its whole timeout for a rank that
    no longer exists and then say only "wait timeout"."""
    keys = [arrival_key(name, rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if (why := dead()) is not None:
            raise TensorParallelError(f"{why} before joining its group: {hint}")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks did not reach the rendezvous within {timeout_s:g} s: "
                                      f"{hint}")
        time.sleep(poll_s)


class TensorParallelGroup:
    def __init__(self, store: dist.TCPStore, name: str, shards: list[RankShard], rank: int,
                 device: torch.device, timeout_s: float) -> None:
        self.shard = shards[rank]
        self.rank, self.world_size = rank, len(shards)
        self.device = device
        self.store = store  # rank 0 hosts the rendezvous: it must live as long as the group
        self.timeout_s = timeout_s
        self.step = 0  # set by the runner: errors name the step they broke
        # seconds waited and bytes sent in each kind of collective (the per-step cost split's source)
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._vocab_sizes = [s.vocab[1] - s.vocab[0] for s in shards]
        self._kv_ranges = [s.kv_heads for s in shards]
        self.num_kv_heads = max(end for _, end in self._kv_ranges)
        prefixed = dist.PrefixStore(f"kvloom-tp/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._group = dist.ProcessGroupNCCL(prefixed, rank, self.world_size, options)
            else:
                self._group = dist.ProcessGroupGloo(prefixed, rank, self.world_size, timeout)
        except RuntimeError as exc:
            raise TensorParallelError(f"tensor-parallel rank {rank} could not join its group: {exc}") from exc

    def _wait(self, operation: str, work, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as exc:  # gloo's and NCCL's errors (DistBackendError is one)
            raise TensorParallelError(f"tensor-parallel rank {self.rank}, step {self.step}: {operation} failed: "
                                      f"{exc}") from exc
        self.seconds[operation] += time.perf_counter() - started
        self.bytes[operation] += tensor.numel() * tensor.element_size()
        self.calls[operation] += 1

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in float32 (it joins the float32 residual stream; bfloat16 partials summed in
        bfloat16 would round before they got there)."""
        total = partial.float().contiguous()
        self._wait("all-reduce", self._group.allreduce([total]), total)
        return total

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows whose ids it holds, zeros elsewhere, then a sum."""
        start, end = self.shard.vocab
        local = input_ids - start
        mine = (local >= 0) & (local < end - start)
        rows = F.embedding(local.clamp(0, end - start - 1), table).float()
        return self.all_reduce(rows.mul_(mine.unsqueeze(1)))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every rank's vocabulary slice, joined on rank 0 (others get None); slices are padded to the widest."""
        width = max(self._vocab_sizes)
        parts = self._gather(F.pad(logits.float(), (0, width - logits.shape[1])).contiguous(), "logits gather")
        if parts is None:
            return None
        return torch.cat([part[:, :size] for part, size in zip(parts, self._vocab_sizes)], dim=1).to(logits.dtype)

    def gather_heads(self, local: torch.Tensor) -> torch.Tensor | None:
        """[..., this rank's KV heads, head_dim] from every rank, as [..., every KV head, head_dim] on rank 0 (a
        head replicated on several ranks is taken once); None elsewhere."""
        width = max(end - start for start, end in self._kv_ranges)
        parts = self._gather(F.pad(local, (0, 0, 0, width - local.shape[-2])).contiguous(), "KV export")
        if parts is None:
            return None
        full = local.new_empty((*local.shape[:-2], self.num_kv_heads, local.shape[-1]))
        for part, (start, end) in zip(parts, self._kv_ranges):
            full[..., start:end, :] = part[..., : end - start, :]
        return full

    def own_heads(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of [..., every KV head, head_dim]."""
        start, end = self.shard.kv_heads
        return full[..., start:end, :]

    def broadcast(self, tensor: torch.Tensor, operation: str) -> torch.Tensor:
        """Rank 0's tensor into everyone's (in place)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(operation, self._group.broadcast([tensor], options), tensor)
        return tensor

    def gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """A few integers from every rank, on rank 0 (start-up reports: bytes held); None elsewhere."""
        parts = self._gather(torch.tensor(values, dtype=torch.int64, device=self.device), "start-up report")
        return None if parts is None else [part.tolist() for part in parts]

    def _gather(self, tensor: torch.Tensor, operation: str) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere), on rank 0; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == 0 else []
        self._wait(operation, self._group.gather(outputs, [tensor], options), tensor)
        return outputs[0] if self.rank == 0 else None
