"""Per-request block tables on top of the block pool, with prefix-cache lookups.

Blocks are allocated as tokens arrive (never a max-length reservation); `allocate_slots` returns
False instead of raising when the pool is short, so the scheduler decides whom to preempt. With KV tiers
(engine/kv_tiers/), full blocks are written through to them as they are registered, and a prefix that misses
the pool goes on in the tiers: the blocks found there are read into fresh pool blocks beside the steps
(tier_io.py) while the request waits, then registered, so they are cached blocks like any other from then on.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvloom.engine.block_pool import BlockPool, KVBlock, hash_block
from kvloom.engine.kv_tiers.tier_io import TierIO
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
    tier_io: TierIO | None = field(init=False)
    _held: dict[str, list[KVBlock]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks)
        self.tier_io = TierIO(self.tiers) if self.tiers is not None else None

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
        parent = request.hash_root
        for block_hash, chunk in self._prompt_blocks(request, parent):
            block = self.pool.lookup(block_hash, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def _prompt_blocks(self, request: Request, parent: int | None, start: int = 0
                       ) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of the request's full blocks from block `start` on, but for the last token's block;
        `parent` is block start - 1's hash."""
        tokens = request.token_ids
        for i in range(start, (len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            yield parent, chunk

    def tier_run(self, request: Request, hits: list[KVBlock]) -> list[tuple[int, tuple[int, ...]]] | None:
        """The blocks (hash, tokens) after the pool's `hits` that a tier holds, in a leading run; None where the
        first of them is being read for another request (this one looks again once that is taken in)."""
        if self.tier_io is None or not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        parent = hits[-1].block_hash if hits else request.hash_root
        run = []
        for block_hash, chunk in self._prompt_blocks(request, parent, len(hits)):  # hashed only as far as held
            if not run and block_hash in self.tier_io.reading:
                return None
            if not self.tiers.holds(block_hash):
                break
            run.append((block_hash, chunk))
        return run

    def begin_tier_load(self, request: Request, run: list[tuple[int, tuple[int, ...]]]) -> None:
        """Read `run` (after the request's cached blocks) into the blocks `allocate_slots` gave it for them."""
        first = request.num_computed_tokens // self.block_size
        self.tier_io.load(request, self._held[request.request_id][first : first + len(run)], run)

    def end_tier_loads(self) -> list[tuple[Request, int]]:
        """Take in the loads the worker finished: (request, tokens loaded) for those whose requests still wait, the
        loaded blocks registered (a block missing or bad ends a run: the rest is computed); a cancelled request's
        blocks freed."""
        if self.tier_io is None:
            return []
        finished = []
        for load in self.tier_io.take_finished():
            if load.cancelled:
                for block in load.released:
                    self.pool.release(block)
                continue
            loaded = load.loaded()
            for block, (block_hash, chunk) in zip(load.blocks[:loaded], load.wanted):
                self.pool.register(block, block_hash, chunk)
                load.request.block_hashes.append(block_hash)
            self.stats.hits -= (len(load.wanted) - loaded) * self.block_size  # counted as hits at admission
            finished.append((load.request, loaded * self.block_size))
        return finished

    @property
    def loading_tiers(self) -> bool:
        """Loads in flight or not yet taken in (a cancelled one's too)."""
        return self.tier_io is not None and bool(self.tier_io.loads)

    def wait_for_tiers(self, timeout: float) -> None:
        if self.tier_io is not None:
            self.tier_io.wait(timeout)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: list[KVBlock] = (), num_loading: int = 0
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is short.

        `cached_prefix` (only for a request holding no blocks yet) is adopted by reference; `num_loading` blocks
        after it are a tier run (`tier_run`) that `begin_tier_load` reads into the fresh blocks given for them.
        """
        held = self._held.setdefault(request.request_id, [])
        total = (request.num_computed_tokens + (len(cached_prefix) + num_loading) * self.block_size
                 + num_new_tokens)
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        fresh = self.blocks_needed(total) - len(held) - len(cached_prefix)
        if fresh + revived > self.pool.num_free:
            if not held:
                del self._held[request.request_id]
            return False
        if not held:
            self._count_lookup(request, (len(cached_prefix) + num_loading) * self.block_size)
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
        if self.tier_io is not None and new:
            self.tier_io.write(new)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Return the blocks past those `num_tokens` tokens need (slots of rejected drafts)."""
        held = self._held[request.request_id]
        keep = self.blocks_needed(num_tokens)
        for block in reversed(held[keep:]):
            self.pool.release(block)
        del held[keep:]
        request.block_ids = request.block_ids[:keep]

    def free(self, request: Request) -> None:
        """Return every block the request holds (a tier load of its own, once the worker is done with it); tail
        blocks go first so they are evicted first."""
        held = self._held.pop(request.request_id, [])
        if self.tier_io is not None and self.tier_io.cancel(request.request_id, held):
            held = []  # the load frees them when the worker is done
        for block in reversed(held):
            self.pool.release(block)
        request.block_ids = []
        request.block_hashes = []

    def num_held(self, request_id: str) -> int:
        return len(self._held.get(request_id, ()))

    @property
    def num_requests_holding(self) -> int:
        return len(self._held)
