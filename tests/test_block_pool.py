"""Specification of the KV block pool and the per-request KV cache manager.

BlockPool: ref counts, an LRU free list whose freed *cached* blocks keep their contents until they
are handed out again, and a hash -> block map for prefix caching. KVCacheManager: per-request block
tables on top of it, prefix lookups, and `allocate_slots` that says False (changing nothing) when
the pool is short.
"""

import copy

import pytest

from kvloom.engine.block_pool import BlockPool, hash_block, prompt_block_hashes
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request
from kvloom.engine.sampling import SamplingParams


def make_request(request_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def compute(kv: KVCacheManager, request: Request, num_new: int, cached=()) -> None:
    """Admit/grow `request` by `num_new` tokens and pretend the model computed them."""
    assert kv.allocate_slots(request, num_new, list(cached))
    if cached:
        request.num_computed_tokens = len(cached) * kv.block_size
    request.num_computed_tokens += num_new
    kv.cache_full_blocks(request)


def chain_hashes(tokens: list[int], block_size: int) -> list[int]:
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def pool_state(pool: BlockPool):
    return (
        list(pool.free),
        [(b.block_id, b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached.items()},
        pool.peak_num_used,
        pool.num_evictions,
    )


def manager_state(kv: KVCacheManager, *requests: Request):
    return (
        pool_state(kv.pool),
        (kv.stats.queries, kv.stats.hits),
        {rid: [b.block_id for b in held] for rid, held in kv._held.items()},
        [(r.block_ids[:], r.block_hashes[:], r.num_computed_tokens) for r in requests],
    )


# ---- BlockPool: allocation and ref counts ---------------------------------------------------------


class TestAllocationAndRefCounts:
    def test_a_new_pool_is_entirely_free_and_uncached(self):
        pool = BlockPool(5)
        assert pool.num_free == 5 and pool.num_used == 0 and pool.usage == 0.0
        assert pool.cached == {} and pool.peak_num_used == 0 and pool.num_evictions == 0
        handed_out = pool.allocate(5)
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in handed_out) and pool.num_evictions == 0

    def test_a_pool_of_a_billion_blocks_is_made_at_once_and_hands_out_ids_from_zero(self):
        pool = BlockPool(10**9)
        assert pool.num_free == 10**9 and pool.blocks == []
        assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2] and pool.num_free == 10**9 - 3

    def test_allocated_blocks_are_distinct_with_one_reference_each(self):
        pool = BlockPool(5)
        blocks = pool.allocate(3)
        assert len({b.block_id for b in blocks}) == 3
        assert all(b.ref_cnt == 1 for b in blocks)
        assert pool.num_used == 3 and pool.num_free == 2 and pool.usage == pytest.approx(0.6)
        assert not any(b.block_id in pool.free for b in blocks)

    def test_release_drops_a_reference_and_frees_at_zero(self):
        pool = BlockPool(2)
        (block,) = pool.allocate(1)
        pool.touch(block)  # a second holder
        assert block.ref_cnt == 2
        pool.release(block)
        assert block.ref_cnt == 1 and block.block_id not in pool.free and pool.num_used == 1
        pool.release(block)
        assert block.ref_cnt == 0 and block.block_id in pool.free and pool.num_used == 0

    def test_releasing_more_often_than_taken_is_an_error(self):
        pool = BlockPool(2)
        (block,) = pool.allocate(1)
        pool.release(block)
        with pytest.raises(RuntimeError):
            pool.release(block)
        assert block.ref_cnt == 0 and pool.num_free == 2

    def test_asking_for_more_than_is_free_raises_and_changes_nothing(self):
        pool = BlockPool(3)
        pool.allocate(2)
        before = pool_state(pool)
        with pytest.raises(RuntimeError):
            pool.allocate(2)
        assert pool_state(pool) == before

    def test_peak_counts_the_most_blocks_ever_in_use(self):
        pool = BlockPool(6)
        a = pool.allocate(4)
        for b in a:
            pool.release(b)
        pool.allocate(2)
        assert pool.peak_num_used == 4
        pool.allocate(3)
        assert pool.peak_num_used == 5

    def test_reviving_a_free_block_counts_towards_the_peak(self):
        pool = BlockPool(3)
        (block,) = pool.allocate(1)
        pool.register(block, 7, (1,))
        pool.release(block)
        pool.allocate(2)
        assert pool.peak_num_used == 2
        pool.touch(block)
        assert pool.num_used == 3 and pool.peak_num_used == 3


# ---- BlockPool: LRU eviction of freed cached blocks -----------------------------------------------


class TestLRUEviction:
    def test_never_used_blocks_are_handed_out_before_freed_cached_ones(self):
        pool = BlockPool(4)
        (cached,) = pool.allocate(1)
        pool.register(cached, 11, (1, 2))
        pool.release(cached)
        fresh = pool.allocate(3)
        assert cached not in fresh
        assert pool.num_evictions == 0 and pool.cached == {11: cached}

    def test_freed_cached_blocks_are_evicted_least_recently_freed_first(self):
        pool = BlockPool(3)
        blocks = pool.allocate(3)
        for i, b in enumerate(blocks):
            pool.register(b, 100 + i, (i,))
        for b in (blocks[1], blocks[2], blocks[0]):  # free order: 1, 2, 0
            pool.release(b)
        assert pool.allocate(1) == [blocks[1]]
        assert pool.allocate(1) == [blocks[2]]
        assert set(pool.cached) == {100}

    def test_eviction_forgets_the_hash_and_contents(self):
        pool = BlockPool(1)
        (block,) = pool.allocate(1)
        pool.register(block, 5, (9, 9))
        pool.release(block)
        (again,) = pool.allocate(1)
        assert again is block
        assert block.block_hash is None and block.token_ids == () and block.ref_cnt == 1
        assert pool.cached == {} and pool.num_evictions == 1
        assert pool.lookup(5, (9, 9)) is None

    def test_a_revived_then_refreed_block_moves_to_the_back_of_the_lru(self):
        pool = BlockPool(2)
        a, b = pool.allocate(2)
        pool.register(a, 1, (1,))
        pool.register(b, 2, (2,))
        pool.release(a)
        pool.release(b)  # LRU order: a, b
        pool.touch(a)
        pool.release(a)  # a used more recently now: b, a
        assert pool.allocate(1) == [b]

    def test_manager_frees_tail_blocks_first_so_they_are_evicted_first(self):
        kv = KVCacheManager(num_blocks=4, block_size=2)
        tokens = [1, 2, 3, 4, 5, 6, 7]  # three full blocks + one partial
        req = make_request("a", tokens)
        compute(kv, req, len(tokens))
        table = list(req.block_ids)
        kv.free(req)
        # free list (LRU first) lists the request's blocks tail first
        assert list(kv.pool.free) == table[::-1]
        # taking one block evicts the partial tail, the next evicts the last *full* block
        (taken,) = kv.pool.allocate(1)
        assert taken.block_id == table[3] and kv.pool.num_evictions == 0
        (taken,) = kv.pool.allocate(1)
        assert taken.block_id == table[2] and kv.pool.num_evictions == 1
        # the head of the prefix survives and still hits
        hits = kv.find_cached_prefix(make_request("b", tokens))
        assert [b.block_id for b in hits] == table[:2]


# ---- prefix cache: lookup, registration, hits -----------------------------------------------------


class TestPrefixLookup:
    def test_lookup_needs_equal_tokens_not_just_an_equal_hash(self):
        pool = BlockPool(2)
        (block,) = pool.allocate(1)
        h = hash_block(None, (1, 2))
        pool.register(block, h, (3, 4))  # same hash, other tokens (a collision)
        assert pool.lookup(h, (1, 2)) is None
        assert pool.lookup(h, (3, 4)) is block

    def test_manager_misses_when_the_cached_block_holds_other_tokens(self):
        kv = KVCacheManager(num_blocks=4, block_size=2)
        (block,) = kv.pool.allocate(1)
        kv.pool.register(block, hash_block(None, (1, 2)), (8, 9))
        kv.pool.release(block)
        assert kv.find_cached_prefix(make_request("r", [1, 2, 3])) == []

    def test_the_first_block_registered_under_a_hash_wins(self):
        pool = BlockPool(3)
        a, b = pool.allocate(2)
        pool.register(a, 42, (1,))
        pool.register(b, 42, (1,))
        assert pool.cached == {42: a} and b.block_hash is None

    def test_a_block_keeps_its_first_hash(self):
        pool = BlockPool(2)
        (a,) = pool.allocate(1)
        pool.register(a, 1, (1,))
        pool.register(a, 2, (2,))
        assert a.block_hash == 1 and pool.cached == {1: a}

    def test_cache_full_blocks_registers_exactly_the_computed_full_blocks_by_chained_hash(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        tokens = list(range(10, 21))  # 11 tokens: two full blocks and 3 over
        req = make_request("r", tokens)
        compute(kv, req, 6)  # one full block computed
        assert req.block_hashes == chain_hashes(tokens[:4], 4)
        compute(kv, req, 5)
        expected = chain_hashes(tokens, 4)
        assert req.block_hashes == expected and len(expected) == 2
        held = [kv.pool.blocks[i] for i in req.block_ids]
        assert [b.block_hash for b in held] == expected + [None]
        assert held[1].token_ids == tuple(tokens[4:8])

    def test_a_hit_revives_a_freed_cached_block(self):
        kv = KVCacheManager(num_blocks=6, block_size=2)
        tokens = [5, 6, 7, 8, 9]
        a = make_request("a", tokens)
        compute(kv, a, len(tokens))
        prefix_ids = a.block_ids[:2]
        kv.free(a)
        assert kv.pool.num_free == 6
        assert all(kv.pool.blocks[i].ref_cnt == 0 for i in prefix_ids)

        b = make_request("b", tokens)
        hits = kv.find_cached_prefix(b)
        assert [h.block_id for h in hits] == prefix_ids
        assert kv.allocate_slots(b, 1, hits)
        assert b.block_ids[:2] == prefix_ids and len(b.block_ids) == 3
        assert all(kv.pool.blocks[i].ref_cnt == 1 for i in prefix_ids)
        assert not any(i in kv.pool.free for i in prefix_ids)
        assert kv.pool.num_used == 3 and kv.pool.num_evictions == 0
        assert b.block_hashes == chain_hashes(tokens[:4], 2)

    def test_a_hit_on_a_live_block_shares_it(self):
        kv = KVCacheManager(num_blocks=6, block_size=2)
        tokens = [1, 2, 3, 4, 5]
        a = make_request("a", tokens)
        compute(kv, a, len(tokens))
        b = make_request("b", tokens[:4] + [99, 98])
        hits = kv.find_cached_prefix(b)
        assert len(hits) == 2
        assert kv.allocate_slots(b, 2, hits)
        shared = a.block_ids[:2]
        assert b.block_ids[:2] == shared
        assert all(kv.pool.blocks[i].ref_cnt == 2 for i in shared)
        assert kv.pool.num_used == 4
        kv.free(a)
        assert all(kv.pool.blocks[i].ref_cnt == 1 for i in shared)
        assert kv.pool.num_used == 3
        kv.free(b)
        assert kv.pool.num_used == 0

    def test_hits_stop_at_the_first_miss(self):
        kv = KVCacheManager(num_blocks=8, block_size=2)
        a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
        compute(kv, a, 7)
        b = make_request("b", [1, 2, 0, 0, 5, 6, 7])  # block 2 equals a's, but its parent differs
        assert [h.block_id for h in kv.find_cached_prefix(b)] == a.block_ids[:1]

    def test_disabled_prefix_caching_never_hits_nor_registers(self):
        kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
        a = make_request("a", [1, 2, 3, 4, 5])
        compute(kv, a, 5)
        assert a.block_hashes == [] and kv.pool.cached == {}
        assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []
        assert (kv.stats.queries, kv.stats.hits) == (0, 0)

    def test_prompt_block_hashes_match_what_the_manager_registers(self):
        """The router hashes prompts itself; its hashes must name the blocks replicas cache."""
        kv = KVCacheManager(num_blocks=16, block_size=4)
        tokens = list(range(30, 45))  # 15 tokens: 3 full blocks
        req = make_request("r", tokens)
        compute(kv, req, len(tokens))
        assert prompt_block_hashes(tokens, 4) == req.block_hashes == chain_hashes(tokens, 4)
        assert len(req.block_hashes) == 3
        assert all(h in kv.pool.cached for h in prompt_block_hashes(tokens, 4))
        assert prompt_block_hashes(tokens[:3], 4) == []

    def test_recent_hashes_lists_the_latest_registered_and_drops_evicted(self):
        pool = BlockPool(3)
        blocks = pool.allocate(3)
        for i, b in enumerate(blocks):
            pool.register(b, 10 + i, (i,))
        assert pool.recent_hashes(2) == [11, 12]
        assert pool.recent_hashes(10) == [10, 11, 12]
        pool.release(blocks[0])
        pool.allocate(1)  # evicts hash 10
        assert pool.recent_hashes(10) == [11, 12]


class TestFindCachedPrefixLeavesTheLastToken:
    @pytest.mark.parametrize("block_size", [1, 2, 4])
    @pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 8, 9])
    def test_never_all_tokens(self, block_size, num_tokens):
        kv = KVCacheManager(num_blocks=64, block_size=block_size)
        tokens = list(range(100, 100 + num_tokens))
        a = make_request("a", tokens + [7] * 8)  # caches every block of `tokens` and more
        compute(kv, a, a.num_tokens)
        hits = kv.find_cached_prefix(make_request("b", tokens))
        assert len(hits) * block_size <= num_tokens - 1
        # ... and it is the longest such run of full blocks
        assert len(hits) == (num_tokens - 1) // block_size

    def test_a_prompt_of_exactly_whole_cached_blocks_recomputes_its_last_block(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        tokens = list(range(8))
        a = make_request("a", tokens)
        compute(kv, a, 8)
        assert len(a.block_hashes) == 2
        b = make_request("b", tokens)
        hits = kv.find_cached_prefix(b)
        assert len(hits) == 1
        assert kv.allocate_slots(b, 4, hits)
        assert len(b.block_ids) == 2 and b.block_ids[0] == a.block_ids[0]
        assert b.block_ids[1] != a.block_ids[1]


# ---- allocate_slots ---------------------------------------------------------------------------------


class TestAllocateSlots:
    def test_allocates_blocks_as_tokens_arrive(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        req = make_request("r", list(range(6)))
        compute(kv, req, 6)
        assert len(req.block_ids) == 2 and kv.num_held("r") == 2
        req.token_ids.append(0)
        compute(kv, req, 1)  # 7 tokens: still 2 blocks
        assert len(req.block_ids) == 2
        req.token_ids.extend([0, 0])
        compute(kv, req, 2)  # 9 tokens: 3 blocks
        assert len(req.block_ids) == 3 and kv.pool.num_used == 3

    def test_returns_false_without_side_effects_when_admission_is_short(self):
        kv = KVCacheManager(num_blocks=3, block_size=2)
        other = make_request("o", [1, 2, 3])
        compute(kv, other, 3)  # holds 2 of 3 blocks
        req = make_request("r", [7, 7, 7, 7, 7])
        before = manager_state(kv, other, req)
        assert not kv.allocate_slots(req, 5)
        assert manager_state(kv, other, req) == before
        assert kv.num_requests_holding == 1 and "r" not in kv._held

    def test_returns_false_without_side_effects_when_growth_is_short(self):
        kv = KVCacheManager(num_blocks=2, block_size=2)
        req = make_request("r", [1, 2, 3, 4])
        compute(kv, req, 4)
        req.token_ids.append(5)
        before = manager_state(kv, req)
        assert not kv.allocate_slots(req, 1)
        assert manager_state(kv, req) == before

    def test_revived_cached_blocks_count_against_the_free_blocks(self):
        kv = KVCacheManager(num_blocks=4, block_size=2)
        tokens = [1, 2, 3, 4, 5]
        a = make_request("a", tokens)
        compute(kv, a, 5)
        kv.free(a)  # 2 cached blocks in the free list
        hog = make_request("hog", [9, 9, 9, 9])
        hog_blocks = kv.pool.allocate(1)  # leaves 3 free, 2 of them the cached prefix
        b = make_request("b", tokens + [6, 7, 8])  # 8 tokens = 4 blocks, 2 of them hits
        hits = kv.find_cached_prefix(b)
        assert len(hits) == 2
        before = manager_state(kv, b)
        # needs 2 revived + 2 fresh = 4 > 3 free
        assert not kv.allocate_slots(b, 4, hits)
        assert manager_state(kv, b) == before
        # with the hog's block back, 2 revived + 2 fresh fit exactly
        kv.pool.release(hog_blocks[0])
        del hog
        assert kv.allocate_slots(b, 4, hits)
        assert kv.pool.num_free == 0 and len(b.block_ids) == 4

    def test_a_fresh_allocation_never_evicts_the_hits_it_is_adopting(self):
        kv = KVCacheManager(num_blocks=3, block_size=2)
        tokens = [1, 2, 3, 4]
        a = make_request("a", tokens)
        compute(kv, a, 4)  # blocks 0 and 1, both cached
        kv.free(a)
        (x,) = kv.pool.allocate(1)
        kv.pool.release(x)  # LRU order now: the two cached hits first, then the plain block
        assert list(kv.pool.free)[-1] == x.block_id
        b = make_request("b", tokens + [5])
        hits = kv.find_cached_prefix(b)
        assert len(hits) == 2
        assert kv.allocate_slots(b, 1, hits)
        assert [kv.pool.blocks[i] for i in b.block_ids] == hits + [x]
        assert all(h.block_hash is not None and h.ref_cnt == 1 for h in hits)
        assert kv.pool.num_evictions == 0

    def test_free_returns_everything_and_clears_the_request_tables(self):
        kv = KVCacheManager(num_blocks=4, block_size=2)
        req = make_request("r", [1, 2, 3])
        compute(kv, req, 3)
        kv.free(req)
        assert req.block_ids == [] and req.block_hashes == []
        assert kv.num_requests_holding == 0 and kv.pool.num_free == 4
        kv.free(req)  # freeing twice is harmless
        assert kv.pool.num_free == 4


class TestPrefixStats:
    def test_one_query_and_hit_count_per_admission(self):
        kv = KVCacheManager(num_blocks=16, block_size=2)
        tokens = [1, 2, 3, 4, 5, 6, 7]
        a = make_request("a", tokens)
        compute(kv, a, 3)  # admission: 7 tokens looked up, none hit
        assert (kv.stats.queries, kv.stats.hits) == (7, 0)
        compute(kv, a, 4)  # growth of a running request is no new lookup
        a.token_ids.append(8)
        compute(kv, a, 1)
        assert (kv.stats.queries, kv.stats.hits) == (7, 0)

        b = make_request("b", tokens)
        hits = kv.find_cached_prefix(b)
        compute(kv, b, 1, hits)
        assert (kv.stats.queries, kv.stats.hits) == (14, 6)

    def test_a_failed_admission_counts_nothing(self):
        kv = KVCacheManager(num_blocks=2, block_size=2)
        a = make_request("a", [1, 2, 3, 4, 5])
        assert not kv.allocate_slots(a, 5)
        assert (kv.stats.queries, kv.stats.hits) == (0, 0)

    def test_a_readmission_after_preemption_counts_again(self):
        kv = KVCacheManager(num_blocks=8, block_size=2)
        a = make_request("a", [1, 2, 3, 4, 5])
        compute(kv, a, 5)
        a.token_ids.append(6)
        kv.free(a)
        a.num_computed_tokens = 0
        hits = kv.find_cached_prefix(a)
        assert len(hits) == 2
        compute(kv, a, 2, hits)
        assert (kv.stats.queries, kv.stats.hits) == (5 + 6, 4)
        assert kv.stats.hits <= kv.stats.queries


class TestFork:
    """n > 1: a choice forks its sibling's prompt KV copy-on-write (KVCacheManager.fork)."""

    def test_full_blocks_are_shared_and_the_partial_last_block_is_copied(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        a = make_request("a", list(range(1, 11)))  # 10 tokens: blocks of 4, 4, 2
        compute(kv, a, 10)
        b = make_request("b", list(range(1, 11)))
        copies = kv.fork(a, b, 9)  # all but the last prompt token, which b computes for its own logits
        assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
        assert copies == [(a.block_ids[2], b.block_ids[2])]
        assert [kv.pool.blocks[i].ref_cnt for i in a.block_ids] == [2, 2, 1]
        assert b.block_hashes == a.block_hashes[:2] and kv.pool.num_used == 4
        assert (kv.stats.queries, kv.stats.hits) == (10 + 10, 9)

    def test_a_prompt_ending_on_a_block_boundary_copies_nothing(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        a = make_request("a", list(range(1, 10)))  # 9 tokens: the 9th opens a block of its own
        compute(kv, a, 9)
        b = make_request("b", list(range(1, 10)))
        assert kv.fork(a, b, 8) == []
        assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids

    def test_freeing_either_side_keeps_what_the_other_holds(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        a, b = make_request("a", list(range(1, 11))), make_request("b", list(range(1, 11)))
        compute(kv, a, 10)
        kv.fork(a, b, 9)
        kv.free(a)
        assert kv.pool.num_used == 3 and all(kv.pool.blocks[i].ref_cnt == 1 for i in b.block_ids)
        kv.free(b)
        assert kv.pool.num_used == 0

    def test_a_short_pool_forks_nothing(self):
        kv = KVCacheManager(num_blocks=3, block_size=4)
        a = make_request("a", list(range(1, 11)))
        compute(kv, a, 10)
        b = make_request("b", list(range(1, 11)))
        before = copy.deepcopy(manager_state(kv, a, b))
        assert kv.fork(a, b, 9) is None
        assert manager_state(kv, a, b) == before


def test_manager_state_helper_sees_changes():
    """Guard for the no-side-effect tests: the snapshot must notice a real change."""
    kv = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request("r", [1, 2, 3])
    before = copy.deepcopy(manager_state(kv, req))
    compute(kv, req, 3)
    assert manager_state(kv, req) != before
