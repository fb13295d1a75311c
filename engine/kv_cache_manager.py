"""Per-request block tables on top of the block pool, with prefix-cache lookups.

Blocks are allocated as tokens arrive (never a max-length reservation); `allocate_slots` returns
False instead of raising when the pool is short, so the scheduler decides whom to preempt. With KV tiers
(engine/kv_tiers/), full blocks are written through to them as they are registered, and a prefix that misses
the pool goes on in the tiers: the blocks found there are copied into fresh pool blocks and registered, so they
are cached blocks like any other from then on.
"""

from dataclasses import dataclass, field

from kvloom.engine.block_pool import BlockPool, KVBlock, hash_block
from kvloom.engine.kv_tiers.tiers import KVTiers
from kvloom.engine.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission (a re-admitted request counts its outputs too)
    hits: int = 0  # of those, tokens found cached


@dataclass
class KVCacheManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    tiers: KVTiers | None = None
    pool: BlockPool = field(init=False)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _held: dict[str, list[KVBlock]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of the request's full blocks already in the cache.

        At most `num_tokens - 1` tokens may hit: the last token must be computed for its logits. None for a request
        asking for prompt logprobs: they come from its prompt's logits (engine/prompt_logprobs.py).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[KVBlock] = []
        missed: list[tuple[int, tuple[int, ...]]] = []  # (hash, tokens) of the blocks after the pool's run
        parent = request.hash_root
        tokens = request.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            block = self.pool.lookup(parent, chunk) if not missed else None
            if block is not None:
                hits.append(block)
            elif self.tiers is None:
                break
            else:
                missed.append((parent, chunk))
        return hits + (self._restore(hits, missed) if missed else [])

    def _restore(self, hits: list[KVBlock], missed: list[tuple[int, tuple[int, ...]]]) -> list[KVBlock]:
        """The leading run of `missed` that a tier holds, copied into fresh pool blocks and registered (cached, held
        by no one: the caller adopts them with the hits). The hits stay pinned meanwhile, and the pool keeps a
        block for the prompt's last token."""
        limit = self.pool.num_free - sum(b.ref_cnt == 0 for b in hits) - 1
        payloads = self.tiers.fetch(missed, limit) if limit > 0 else []
        if not payloads:
            return []
        for block in hits:
            self.pool.touch(block)
        restored = self.pool.allocate(len(payloads))
        self.tiers.restore([b.block_id for b in restored], payloads)
        for block, (block_hash, chunk) in zip(restored, missed):
            self.pool.register(block, block_hash, chunk)
        for block in hits + restored:
            self.pool.release(block)
        return restored

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: list[KVBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is short.

        `cached_prefix` (only for a request holding no blocks yet) is adopted by reference.
        """
        held = self._held.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        fresh = self.blocks_needed(total) - len(held) - len(cached_prefix)
        if fresh + revived > self.pool.num_free:
            if not held:
                del self._held[request.request_id]
            return False
        if not held:
            self._count_lookup(request, len(cached_prefix) * self.block_size)
        for block in cached_prefix:
            self.pool.touch(block)
        held.extend(cached_prefix)
        if cached_prefix:
            request.block_hashes = [b.block_hash for b in cached_prefix]
        if fresh > 0:
            held.extend(self.pool.allocate(fresh))
        request.block_ids = [b.block_id for b in held]
        return True

    def _count_lookup(self, request: Request, hit_tokens: int) -> None:
        """Prefix-cache stats, once per request: when it first gets blocks (allocated or forked)."""
        if self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += hit_tokens

    def fork(self, source: Request, request: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `request` (holding no blocks) the KV of `source`'s first `num_tokens` tokens, copy-on-write, and
        room for one token more. Full blocks are shared by reference (nobody writes a full block again); a
        partial last block is copied into a fresh block of its own, which the caller must fill: returns that
        (source block, copy) pair, or nothing when the tokens end on a block boundary; None if the pool is short.
        """
        num_full = num_tokens // self.block_size
        if self.pool.num_free < 1:  # the copy, or the block the next token opens
            return None
        source_blocks = self._held[source.request_id]
        shared = source_blocks[:num_full]
        for block in shared:
            self.pool.touch(block)
        fresh = self.pool.allocate(1)
        self._held[request.request_id] = shared + fresh
        request.block_ids = [b.block_id for b in shared + fresh]
        request.block_hashes = source.block_hashes[:num_full]
        self._count_lookup(request, num_tokens)
        if num_tokens % self.block_size == 0:
            return []
        return [(source_blocks[num_full].block_id, fresh[0].block_id)]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks (their KV is now computed)."""
        if not self.enable_prefix_caching:
            return
        held = self._held[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        tokens = request.token_ids
        new = []
        for i in range(len(request.block_hashes), num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = request.block_hashes[-1] if request.block_hashes else request.hash_root
            block_hash = hash_block(parent, chunk)
            request.block_hashes.append(block_hash)
            self.pool.register(held[i], block_hash, chunk)
            new.append((held[i].block_id, block_hash, chunk))
        if self.tiers is not None and new:
            self.tiers.offer(new)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Return the blocks past those `num_tokens` tokens need (slots of rejected drafts)."""
        held = self._held[request.request_id]
        keep = self.blocks_needed(num_tokens)
        for block in reversed(held[keep:]):
            self.pool.release(block)
        del held[keep:]
        request.block_ids = request.block_ids[:keep]

    def free(self, request: Request) -> None:
        """Return every block the request holds; tail blocks go first so they are evicted first."""
        for block in reversed(self._held.pop(request.request_id, [])):
            self.pool.release(block)
        request.block_ids = []
        request.block_hashes = []

    def num_held(self, request_id: str) -> int:
        return len(self._held.get(request_id, ()))

    @property
    def num_requests_holding(self) -> int:
        return len(self._held)
