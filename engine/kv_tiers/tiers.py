"""The engine's KV tiers: full blocks written through to the node's host tier as they are computed (so another
replica of the node, a replica that joins or restarts, or this one after evicting them, finds them there), and
read back, host first, then disk, into fresh pool blocks when a prompt's prefix misses the pool.

Loading runs in the scheduler's admission, before the step that uses the blocks (a copy of tens of KB a layer per
block where computing them is a forward pass; the report has both figures). Counters per tier say what was found,
written and how long loading took (`EngineStats.kv_tiers`).
"""

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvloom.engine.config import KVTiersConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.kv_tiers.block_store import BlockStore


@dataclass
class TierStats:
    hits: int = 0  # blocks found
    misses: int = 0  # blocks looked up and not found (the first miss of a prefix ends its lookup)
    blocks_written: int = 0
    bytes_read: int = 0
    load_s: float = 0.0


def opened(root: Path, budget: int, identity: bytes, below: BlockStore | None, field: str) -> BlockStore:
    """A tier's store, in `root`'s folder for this identity; a folder that cannot be made is a config error."""
    try:
        return BlockStore(root / identity.hex(), budget, identity, below)
    except OSError as exc:
        raise ConfigError(field, f"cannot keep KV blocks in {root}: {exc}") from None


def kv_identity(model_dir: Path, kv_dtype: torch.dtype, block_shape: tuple[int, ...]) -> bytes:
    """What a stored block's KV depends on besides its tokens: the checkpoint (its files' names, sizes and times),
    the KV dtype and the block layout [layers, 2, block_size, kv_heads, head_dim]."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    return hashlib.blake2b(repr((files, str(kv_dtype), block_shape)).encode(), digest_size=16).digest()


@dataclass
class KVTiers:
    stores: dict[str, BlockStore]  # "host" and/or "disk", searched in that order
    export_blocks: Callable[[list[int]], torch.Tensor]  # the runner's: [layers, 2, blocks, block_size, heads, dim]
    import_blocks: Callable[[list[int], torch.Tensor], None]
    block_shape: tuple[int, ...]  # one block's [layers, 2, block_size, kv_heads, head_dim]
    kv_dtype: torch.dtype
    stats: dict[str, TierStats] = field(default_factory=dict)
    restore_s: float = 0.0  # writing fetched blocks into the pool

    def __post_init__(self) -> None:
        self.stats = {name: TierStats() for name in self.stores}

    @staticmethod
    def build(config: KVTiersConfig, identity: bytes, export_blocks, import_blocks, block_shape: tuple[int, ...],
              kv_dtype: torch.dtype) -> "KVTiers | None":
        disk = (opened(Path(config.disk.path), config.disk.bytes, identity, None, "kv_tiers.disk.path")
                if config.disk is not None and config.disk.bytes else None)
        host = (opened(Path(config.host_path), config.host_bytes, identity, disk, "kv_tiers.host_path")
                if config.host_bytes else None)
        stores = {name: store for name, store in (("host", host), ("disk", disk)) if store is not None}
        return KVTiers(stores, export_blocks, import_blocks, block_shape, kv_dtype) if stores else None

    @property
    def first(self) -> BlockStore:
        return next(iter(self.stores.values()))

    def offer(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Write newly computed full blocks (block id, hash, tokens) to the first tier, those it lacks."""
        blocks = [b for b in blocks if not self.first.contains(b[1])]
        if not blocks:
            return
        payload = self.export_blocks([block_id for block_id, _, _ in blocks]).cpu()
        name = next(iter(self.stores))
        for i, (_, block_hash, tokens) in enumerate(blocks):
            data = payload[:, :, i].contiguous().view(torch.uint8).numpy().tobytes()
            self.stats[name].blocks_written += self.first.put(block_hash, tokens, data)

    def fetch(self, wanted: list[tuple[int, tuple[int, ...]]], limit: int) -> list[memoryview]:
        """The payloads of the leading run of `wanted` (hash, tokens) that some tier holds, at most `limit`."""
        found: list[memoryview] = []
        for block_hash, tokens in wanted[:limit]:
            payload = None
            for name, store in self.stores.items():
                started = time.perf_counter()
                payload = store.get(block_hash, tokens)
                stats = self.stats[name]
                if payload is None:
                    stats.misses += 1
                    continue
                stats.hits, stats.bytes_read = stats.hits + 1, stats.bytes_read + len(payload)
                stats.load_s += time.perf_counter() - started
                break
            if payload is None:
                break
            found.append(payload)
        return found

    def restore(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        """Write fetched payloads into these pool blocks."""
        started = time.perf_counter()
        blocks = [torch.frombuffer(p, dtype=torch.uint8).view(self.kv_dtype).view(self.block_shape) for p in payloads]
        self.import_blocks(block_ids, torch.stack(blocks, dim=2))
        self.restore_s += time.perf_counter() - started

    def as_dict(self) -> dict:
        return {"restore_s": self.restore_s, **{name: vars(stats) | {"used_bytes": self.stores[name].used_bytes()}
                                                for name, stats in self.stats.items()}}
