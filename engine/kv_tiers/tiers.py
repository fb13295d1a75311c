"""The engine's KV tiers: full blocks written through to the node's host tier as they are computed (so another
replica of the node, a replica that joins or restarts, or this one after evicting them, finds them there), and
read back, host first, then disk, into fresh pool blocks when a prompt's prefix misses the pool.

`KVTiers` is what the tiers hold and how a block goes in and out; its reads and writes run on tier_io.py's worker
thread, beside the engine's steps. A load reads block files straight into a staging buffer, checks them there and
copies the KV into the pool in one pass per layer (pool_copy.py: on CUDA from pinned memory on a stream of its own).
Counters per tier say what was found, written and how long loading took (`EngineStats.kv_tiers`).
"""

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvloom.engine.config import KVTiersConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.kv_tiers.block_store import BlockStore, file_bytes, payload_offset
from kvloom.engine.kv_tiers.pool_copy import PoolCopy


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
    copy: PoolCopy
    stats: dict[str, TierStats] = field(default_factory=dict)

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
        return KVTiers(stores, export_blocks, import_blocks, block_shape, kv_dtype, PoolCopy(device)) if stores else None

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
        rows = self.copy.rows(len(wanted), file_bytes(self.block_size, self.payload_bytes))
        offset = payload_offset(self.block_size)
        found = 0
        for (block_hash, tokens), row in zip(wanted, rows):
            if not self._read(block_hash, tokens, memoryview(row.numpy())):
                break
            found += 1
        if found:
            def place(files: torch.Tensor) -> None:  # the files' payloads, as [layers, 2, blocks, ...] KV
                kv = files[:, offset:].view(self.kv_dtype).view(found, *self.block_shape).movedim(0, 2)
                self.import_blocks(block_ids[:found], kv)
            self.copy.into_pool(rows[:found], place)
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

    def as_dict(self) -> dict:
        return {"restore_s": self.copy.seconds, **{name: vars(stats) | {"used_bytes": self.stores[name].used_bytes()}
                                                for name, stats in self.stats.items()}}

    def recent_hashes(self, limit: int) -> list[int]:
        """At most `limit` hashes of blocks the node's tiers hold, as this process lately saw them: what its replica
        reports for the router's prefix affinity. The host's come last, so a cut drops the disk's oldest first."""
        seen = dict.fromkeys(h for store in reversed(self.stores.values()) for h in store.seen.latest(limit))
        return list(seen)[-limit:]
