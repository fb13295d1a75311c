"""The pool of fixed-size KV blocks: ref counts, an LRU free list and the prefix-cache hash map.

A freed block keeps its hash and contents, so a later request with the same prefix can take it
back (a prefix-cache hit) until the block is handed out again; the free list is LRU-ordered so
the least recently used cached blocks are evicted first. Blocks come into being on first use, so a pool
of millions of blocks (a small model on a large budget) costs nothing until it fills.
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the full block's tokens, compared on a hash hit


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained 128-bit BLAKE2 hash: a block's identity depends on every token before it.

    Cryptographic and process-independent: prefixes from different tenants cannot be crafted to
    collide (Python's `hash` could be), and the router can compute a prompt's block hashes and
    match them against what replicas report as cached.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update((parent_hash or 0).to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, root: int | None = None) -> list[int]:
    """Chained hashes of every full block of a prompt, in order; `root`: a LoRA adapter's (engine/lora/identity.py)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else root, tuple(token_ids[start : start + block_size])))
    return hashes


@dataclass
class BlockPool:
    num_blocks: int
    blocks: list[KVBlock] = field(init=False)  # every block handed out so far, by id; the rest never were
    free: "OrderedDict[int, KVBlock]" = field(init=False)  # released blocks, LRU first
    cached: dict[int, KVBlock] = field(init=False)  # hash -> block
    peak_num_used: int = 0
    num_evictions: int = 0

    def __post_init__(self) -> None:
        self.blocks = []
        self.free = OrderedDict()
        self.cached = {}

    @property
    def num_free(self) -> int:
        return len(self.free) + self.num_blocks - len(self.blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        """Hand out `count` fresh blocks: never-used ones first, then released ones, evicting the least recently
        used cached ones."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free} free")
        taken = []
        for _ in range(count):
            if len(self.blocks) < self.num_blocks:
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
                self.num_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        self.peak_num_used = max(self.peak_num_used, self.num_used)
        return taken

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, block: KVBlock) -> None:
        """Take one more reference to a cached block (reviving it from the free list)."""
        if block.ref_cnt == 0:
            del self.free[block.block_id]
        block.ref_cnt += 1
        self.peak_num_used = max(self.peak_num_used, self.num_used)

    def release(self, block: KVBlock) -> None:
        if block.ref_cnt <= 0:
            raise RuntimeError(f"block {block.block_id} released more often than taken")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free[block.block_id] = block

    def register(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Make a full block findable by its hash; the first block with a given hash wins."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block

    def recent_hashes(self, limit: int) -> list[int]:
        """The most recently registered cached-block hashes (a compact summary for routing)."""
        hashes = list(self.cached)
        return hashes[-limit:]
