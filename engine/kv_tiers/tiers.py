"""The engine's KV tiers: full blocks written through to the node's host tier as they are computed (so another
replica of the node, a replica that joins or restarts, or this one after evicting them, finds them there), and
read back, host first, then disk, into fresh pool blocks when a prompt's prefix misses the pool.

`KVTiers` is what the tiers hold and how a block goes in and out; its reads and writes run on tier_io.py's worker
thread, beside the engine's steps. A load reads block files straight into a staging buffer (pinned on CUDA, reused
from load to load: fresh buffers cost more in page faults than the read), checks them there and copies the KV into
the pool in one pass per layer (on CUDA one host-to-device copy on the worker's own stream, waited for there).
Counters per tier say what was found, written and how long loading took (`EngineStats.kv_tiers`).
"""

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvloom.engine.config import KVTiersConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.kv_tiers.block_store import BlockStore, file_bytes, payload_offset


@dataclass
class TierStats:
    hits: int = 0  # blocks found
    misses: int = 0  # blocks looked up and not found (the first miss of a prefix ends its lookup)
    blocks_written: int = 0
    writes_dropped: int = 0  # blocks not offered to the tier: its writes were too far behind (tier_io.py)
    bytes_read: int = 0
    load_s: float = 0.0


def opened(root: Path, budget: int, identity: bytes, below: BlockStore | None, field: str) -> BlockStore:
    """A tier's store, in `root`'s folder for this identity; a folder that cannot be made is a config error."""
    try:
        return BlockStore(root / identity.hex(), budget, identity, below)
    except OSError as exc:
        raise ConfigError(field, f"cannot keep KV blocks in {root}: {exc}") from None


def kv_identity(model_dir: Path, kv_dtype: torch.dtype, block_shape: tuple[int, ...],
                quantization: str | None = None) -> bytes:
    """What a stored block's KV depends on besides its tokens: the checkpoint (its files' names, sizes and times),
    the weights' form (quantized or not), the KV dtype and the block layout [layers, 2, block_size, kv_heads,
    head_dim]."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    return hashlib.blake2b(repr((files, quantization, str(kv_dtype), block_shape)).encode(), digest_size=16).digest()


@dataclass
class KVTiers:
    stores: dict[str, BlockStore]  # "host" and/or "disk", searched in that order
    export_blocks: Callable[[list[int]], torch.Tensor]  # the runner's: [layers, 2, blocks, block_size, heads, dim]
    import_blocks: Callable[[list[int], torch.Tensor], None]
    block_shape: tuple[int, ...]  # one block's [layers, 2, block_size, kv_heads, head_dim]
    kv_dtype: torch.dtype
    device: torch.device
    stats: dict[str, TierStats] = field(default_factory=dict)
    restore_s: float = 0.0  # copying loaded blocks into the pool
    _staging: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.uint8))
    _stream: "torch.cuda.Stream | None" = None  # the worker's copy stream on CUDA

    def __post_init__(self) -> None:
        self.stats = {name: TierStats() for name in self.stores}

    @staticmethod
    def build(config: KVTiersConfig, identity: bytes, export_blocks, import_blocks, block_shape: tuple[int, ...],
              kv_dtype: torch.dtype, device: torch.device) -> "KVTiers | None":
        disk = (opened(Path(config.disk.path), config.disk.bytes, identity, None, "kv_tiers.disk.path")
                if config.disk is not None and config.disk.bytes else None)
        host = (opened(Path(config.host_path), config.host_bytes, identity, disk, "kv_tiers.host_path")
                if config.host_bytes else None)
        stores = {name: store for name, store in (("host", host), ("disk", disk)) if store is not None}
        return KVTiers(stores, export_blocks, import_blocks, block_shape, kv_dtype, device) if stores else None

    @property
    def first(self) -> BlockStore:
        return next(iter(self.stores.values()))

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    @property
    def payload_bytes(self) -> int:
        return torch.Size(self.block_shape).numel() * self.kv_dtype.itemsize

    def holds(self, block_hash: int) -> bool:
        """Whether some tier has a file for the block (checked when read)."""
        return any(store.contains(block_hash) for store in self.stores.values())

    def new_blocks(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> list[tuple[int, int, tuple[int, ...]]]:
        """Of newly computed full blocks (block id, hash, tokens), those the first tier lacks."""
        return [b for b in blocks if not self.first.contains(b[1])]

    def write(self, blocks: list[tuple[int, tuple[int, ...]]], payload: torch.Tensor) -> None:
        """Write blocks (hash, tokens) whose KV `payload` holds ([layers, 2, blocks, ...] on the host) to the first
        tier. On the worker thread."""
        name = next(iter(self.stores))
        for i, (block_hash, tokens) in enumerate(blocks):
            data = memoryview(payload[:, :, i].contiguous().view(torch.uint8).numpy()).cast("B")
            self.stats[name].blocks_written += self.first.put(block_hash, tokens, data)

    def load(self, wanted: list[tuple[int, tuple[int, ...]]], block_ids: list[int]) -> int:
        """Read the leading run of `wanted` that the tiers hold into the pool blocks `block_ids` (one each); returns
        how many were loaded (a block missing or bad ends the run). On the worker thread."""
        rows = self._staging_rows(len(wanted))
        offset = payload_offset(self.block_size)
        found = 0
        for (block_hash, tokens), row in zip(wanted, rows):
            if not self._read(block_hash, tokens, memoryview(row.numpy())):
                break
            found += 1
        if found:
            started = time.perf_counter()
            with self._copy_stream():
                on_device = rows[:found].to(self.device, non_blocking=True)
                kv = on_device[:, offset:].view(self.kv_dtype).view(found, *self.block_shape).movedim(0, 2)
                self.import_blocks(block_ids[:found], kv)
            self.restore_s += time.perf_counter() - started
        return found

    def _read(self, block_hash: int, tokens: tuple[int, ...], out: memoryview) -> bool:
        """One block's file into `out`, from the first tier that holds it whole; counted per tier."""
        for name, store in self.stores.items():
            started = time.perf_counter()
            stats = self.stats[name]
            if store.read_into(block_hash, tokens, out):
                stats.hits, stats.bytes_read = stats.hits + 1, stats.bytes_read + len(out)
                stats.load_s += time.perf_counter() - started
                return True
            stats.misses += 1
        return False

    def _staging_rows(self, count: int) -> torch.Tensor:
        """`count` rows of a block file's size, from a buffer kept from load to load (grown when short)."""
        size = file_bytes(self.block_size, self.payload_bytes)
        if len(self._staging) < count:
            self._staging = torch.empty(max(count, 2 * len(self._staging)), size, dtype=torch.uint8,
                                        pin_memory=self.device.type == "cuda")
        return self._staging[:count]

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """Copies to the pool: on CUDA on a stream of the worker's own, finished before the load is reported done
        (the step's stream then reads them); elsewhere as they are."""
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:  # made once: the worker is the only thread that uses it
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def as_dict(self) -> dict:
        return {"restore_s": self.restore_s, **{name: vars(stats) | {"used_bytes": self.stores[name].used_bytes()}
                                                for name, stats in self.stats.items()}}

    def recent_hashes(self, limit: int) -> list[int]:
        """At most `limit` hashes of blocks the node's tiers hold, as this process lately saw them: what its replica
        reports for the router's prefix affinity. The host's come last, so a cut drops the disk's oldest first."""
        seen = dict.fromkeys(h for store in reversed(self.stores.values()) for h in store.seen.latest(limit))
        return list(seen)[-limit:]
