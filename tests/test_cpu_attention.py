"""The CPU fast path (`kernels/cpu_attention.py`) computes exactly what the oracle does.

`kernels/reference.py` is the definition of paged attention; the fast path may batch, pad and
fuse however it likes but must agree with it within 1e-5 in float32 on every batch shape the
scheduler produces: pure decode, fresh prefill, a prefill chunk over a cached prefix, and any mix
of them. Every cache slot that no request owns holds NaN and the blocks are handed out in a
shuffled order, so reading one slot past a request's context (or a padded block-table entry)
turns the output into NaN instead of passing unnoticed. The oracle itself is checked against
plain dense causal attention, so a bug shared by both cannot hide.
"""

import random

import pytest
import torch

from kvloom.kernels import cpu_attention, reference
from kvloom.kernels.metadata import AttentionMetadata

ATOL = RTOL = 1e-5


@pytest.fixture(autouse=True, params=["cpp-kernels", "torch-fallback"])
def attention_path(request, monkeypatch):
    """Every case runs on the compiled decode and prefill kernels and on the pure-torch fallbacks."""
    if request.param == "cpp-kernels":
        assert cpu_attention.decode_extension() is not None, "the C++ decode kernel failed to build"
        assert cpu_attention.prefill_extension() is not None, "the C++ prefill kernel failed to build"
    else:
        monkeypatch.setattr(cpu_attention, "decode_extension", lambda: None)
        monkeypatch.setattr(cpu_attention, "prefill_extension", lambda: None)
    return request.param

# (num_heads, num_kv_heads, head_dim): the tiny test model's GQA shape, SmolLM2's 9/3 GQA with head_dim
# 64, a wide group (12 query heads on one kv head) and head_dim 128 without GQA; head_dim 24 is not
# compiled into the kernels, so the "cpp-kernels" path must notice and fall back
HEAD_SHAPES = [(4, 2, 16), (9, 3, 64), (12, 1, 32), (2, 2, 128), (3, 1, 24)]


class Case:
    """A batch: request i has `cached[i]` tokens in the cache already and `new[i]` tokens this step."""

    def __init__(self, cached, new, heads, block_size, seed=0, cache_dtype=torch.float32):
        num_heads, kv_heads, head_dim = heads
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = [c + n for c, n in zip(cached, new)]
        self.query_lens = list(new)
        needed = [-(-s // block_size) for s in self.seq_lens]
        num_blocks = sum(needed) + 5  # spare blocks stay NaN-filled
        # block 0 is what padded block-table entries point at: keep it unowned (NaN) so reading padding fails
        ids = list(range(1, num_blocks))
        rng.shuffle(ids)
        self.tables = []
        for n in needed:
            self.tables.append(ids[:n])
            ids = ids[n:]
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
        self.value_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
        # the full K/V history of every request, in plain (unpaged) form for the dense check
        self.keys = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in self.seq_lens]
        self.values = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in self.seq_lens]
        for table, k, v, c in zip(self.tables, self.keys, self.values, cached):
            for pos in range(c):  # the cached prefix, written by earlier steps
                block, offset = table[pos // block_size], pos % block_size
                self.key_cache[block, offset] = k[pos]
                self.value_cache[block, offset] = v[pos]
        self.new_keys = torch.cat([k[c:] for k, c in zip(self.keys, cached)])
        self.new_values = torch.cat([v[c:] for v, c in zip(self.values, cached)])
        self.query = torch.randn(sum(new), num_heads, head_dim, generator=gen)
        self.meta = AttentionMetadata.build(self.query_lens, self.seq_lens, self.tables, block_size)
        self.scale = head_dim**-0.5

    def run(self, impl) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this step's K/V with `impl`, then attend; returns (output, key_cache, value_cache)."""
        key_cache, value_cache = self.key_cache.clone(), self.value_cache.clone()
        impl.write_kv(key_cache, value_cache, self.new_keys, self.new_values, self.meta.slot_mapping)
        out = impl.paged_attention(self.query, key_cache, value_cache, self.meta, self.scale)
        return out, key_cache, value_cache

    def dense(self) -> torch.Tensor:
        """Causal attention over the unpaged K/V, query row j of request i at position seq_len - q_len + j."""
        rows = []
        start = 0
        group = self.query.shape[1] // self.keys[0].shape[1]
        for k, v, q_len, s_len in zip(self.keys, self.values, self.query_lens, self.seq_lens):
            q = self.query[start : start + q_len]
            start += q_len
            scores = torch.einsum("qhd,shd->hqs", q, k.repeat_interleave(group, 1)) * self.scale
            q_pos = torch.arange(s_len - q_len, s_len)[:, None]
            scores = scores.masked_fill(torch.arange(s_len)[None, :] > q_pos, float("-inf"))
            rows.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1)))
        return torch.cat(rows)


def assert_fast_path_matches_reference(case: Case) -> None:
    want, ref_keys, ref_values = case.run(reference)
    got, cpu_keys, cpu_values = case.run(cpu_attention)
    torch.testing.assert_close(ref_keys, cpu_keys, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(ref_values, cpu_values, atol=0, rtol=0, equal_nan=True)
    assert torch.isfinite(want).all(), "the oracle read a slot no request owns"
    # a narrow cache rounds K/V: the oracle then matches unrounded dense attention only roughly, but the
    # fast path reads the same rounded values as the oracle and must still match it exactly as in float32
    exact = case.key_cache.dtype == torch.float32
    torch.testing.assert_close(want, case.dense(), atol=ATOL if exact else 0.05, rtol=RTOL if exact else 0.05)
    assert torch.isfinite(got).all(), "the CPU fast path read a slot no request owns"
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_pure_decode_batch_with_ragged_context_lengths(heads, block_size):
    # contexts from a single token up to several blocks, ends of blocks and one past them
    context = [1, 2, 5, block_size, block_size + 1, 33, 64, 100]
    case = Case([c - 1 for c in context], [1] * len(context), heads, block_size, seed=1)
    assert_fast_path_matches_reference(case)


@pytest.mark.parametrize("pool", [False, True], ids=["openmp", "item-pool"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_decode_batch_dealt_over_threads(threads, pool, kernel_threads):
    """Many decode rows of very unequal context, split over however many threads the kernels are given."""
    rng = random.Random(7)
    context = [rng.choice([1, 7, 16, 17, rng.randint(2, 300)]) for _ in range(40)]
    kernel_threads(threads, pool)
    assert_fast_path_matches_reference(Case([c - 1 for c in context], [1] * len(context), HEAD_SHAPES[1], 16, seed=8))


def test_prompt_chunks_take_the_cpp_kernel_on_avx512_hosts(attention_path):
    """On AVX-512 hosts the "cpp-kernels" cases above run the prefill kernel, not the SDPA fallback; AVX2 hosts
    keep SDPA (the kernel built for 256-bit vectors was slower there)."""
    from kvloom.kernels.host_isa import host_isa

    if attention_path == "cpp-kernels":
        assert cpu_attention.prefill_extension().prefill_supported(64) == host_isa().avx512


@pytest.mark.parametrize("pool", [False, True], ids=["openmp", "item-pool"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_prompt_chunks_dealt_over_threads(threads, pool, kernel_threads):
    """Prompt chunks of very unequal length and prefix in one step (the prefill kernel's work items are
    a few positions of one chunk each, taken costliest first), over however many threads the kernels are given."""
    rng = random.Random(11)
    cached = [rng.choice([0, 0, 3, 16, rng.randint(1, 200)]) for _ in range(12)]
    new = [rng.choice([2, 9, 33, rng.randint(2, 150)]) for _ in range(12)]
    kernel_threads(threads, pool)
    assert_fast_path_matches_reference(Case(cached, new, HEAD_SHAPES[1], 16, seed=12))


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_without_prefix(heads, block_size):
    lengths = [2, 3, 7, block_size, block_size + 1, 40]
    case = Case([0] * len(lengths), lengths, heads, block_size, seed=2)
    assert_fast_path_matches_reference(case)


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_chunk_over_cached_prefix(heads, block_size):
    # chunks that start mid-block, on a block boundary, and span several blocks
    cached = [5, 2 * block_size, 17, 3, 48]
    new = [11, block_size, 2, 30, 7]
    case = Case(cached, new, heads, block_size, seed=3)
    assert_fast_path_matches_reference(case)


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_of_decodes_prefills_and_chunks(heads, block_size):
    # decode rows interleaved with fresh prefills and chunks, in the order a scheduler may pack them
    cached = [40, 0, 9, 0, 70, 16, 3]
    new = [1, 12, 1, 1, 6, 1, 20]
    case = Case(cached, new, heads, block_size, seed=4)
    assert_fast_path_matches_reference(case)


@pytest.mark.parametrize("seed", range(5))
def test_random_batches(seed):
    rng = random.Random(seed)
    heads = HEAD_SHAPES[seed % 2]
    block_size = rng.choice([1, 2, 4, 8, 16, 32])
    num_seqs = rng.randint(1, 8)
    cached = [rng.choice([0, rng.randint(1, 90)]) for _ in range(num_seqs)]
    new = [rng.choice([1, rng.randint(1, 40)]) for _ in range(num_seqs)]
    assert_fast_path_matches_reference(Case(cached, new, heads, block_size, seed=seed))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", HEAD_SHAPES[:2])
def test_narrow_cache_with_a_float32_model(heads, cache_dtype):
    """kv_cache_dtype: new K/V are rounded into the cache, and every read widens them back."""
    case = Case([0, 5, 33, 17, 60], [7, 1, 1, 3, 1], heads, 16, seed=6, cache_dtype=cache_dtype)
    assert_fast_path_matches_reference(case)


# one rounding of the output to bfloat16 (8 significant bits), and on CPUs with AVX512-BF16 the prefill
# kernel's probabilities rounded to bfloat16 before P.V (measured: ~3e-3 at most against float32)
BF16_TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("heads", HEAD_SHAPES[:3])
def test_bfloat16_model_matches_a_float32_reference(heads):
    """A bfloat16 model: bfloat16 queries and K/V over a bfloat16 cache, decode rows and prompt chunks
    (fresh, and over a cached prefix). The fast path computes with float32 sums and rounds its output once,
    so it must agree with the float32 oracle run on the same rounded inputs within that tolerance."""
    case = Case([0, 5, 33, 17, 60, 200, 0, 40], [7, 1, 1, 3, 1, 1, 130, 70], heads, 16, seed=9,
                cache_dtype=torch.bfloat16)
    case.query, case.new_keys, case.new_values = (t.bfloat16() for t in (case.query, case.new_keys, case.new_values))
    got, _, _ = case.run(cpu_attention)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
    case.query = case.query.float()
    want, _, _ = case.run(reference)
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", [[1] * 6, [1, 9, 1, 1, 4, 1]], ids=["decode-step", "mixed-step"])
def test_query_and_kv_read_where_the_fused_qkv_projection_left_them(dtype, new):
    """The decoder hands over strided views into one [T, (H + 2 KVH) * D] QKV output, not contiguous copies:
    the cache and the output must be exactly what contiguous inputs give, in the model's dtype."""
    heads, kv_heads, head_dim = HEAD_SHAPES[1]
    case = Case([3, 0, 40, 16, 20, 100], new, HEAD_SHAPES[1], 16, seed=11, cache_dtype=dtype)
    case.query, case.new_keys, case.new_values = (t.to(dtype) for t in (case.query, case.new_keys, case.new_values))
    want, want_keys, want_values = case.run(cpu_attention)
    qkv = torch.cat([case.query.flatten(1), case.new_keys.flatten(1), case.new_values.flatten(1)], dim=1)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    case.query = q.view(-1, heads, head_dim)
    case.new_keys, case.new_values = k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    assert not case.query.is_contiguous() and not case.new_keys.is_contiguous()
    got, got_keys, got_values = case.run(cpu_attention)
    assert got.dtype == dtype
    assert torch.equal(got_keys.nan_to_num(), want_keys.nan_to_num())
    assert torch.equal(got_values.nan_to_num(), want_values.nan_to_num())
    assert torch.equal(got, want)


def test_bfloat16_decode_step_matches_a_float32_reference():
    """A pure decode step of a bfloat16 model (the kernel's query read in place, its output written in bfloat16)."""
    case = Case([0, 5, 33, 17, 60, 200], [1] * 6, HEAD_SHAPES[1], 16, seed=12, cache_dtype=torch.bfloat16)
    case.query, case.new_keys, case.new_values = (t.bfloat16() for t in (case.query, case.new_keys, case.new_values))
    got, _, _ = case.run(cpu_attention)
    assert got.dtype == torch.bfloat16
    case.query = case.query.float()
    want, _, _ = case.run(reference)
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


@pytest.mark.parametrize("heads", [(9, 3, 64), (12, 1, 32), (10, 2, 128), (2, 1, 64)], ids=["gqa-3", "gqa-12", "gqa-5", "gqa-2"])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_bfloat16_decode_over_any_block_size_and_group(heads, block_size):
    """A bfloat16 model's decode rows with odd and even context lengths (a block's last key alone, the slot past
    it unowned), blocks shorter and longer than one register of scores, and query-head groups that do not
    split evenly into the heads the kernel takes at a time: all within the stated tolerance of float32."""
    context = [1, 2, 5, block_size, block_size + 1, 33, 64, 100]
    case = Case([c - 1 for c in context], [1] * len(context), heads, block_size, seed=13, cache_dtype=torch.bfloat16)
    case.query, case.new_keys, case.new_values = (t.bfloat16() for t in (case.query, case.new_keys, case.new_values))
    got, _, _ = case.run(cpu_attention)
    assert torch.isfinite(got.float()).all(), "the kernel read a slot no request owns"
    case.query = case.query.float()
    want, _, _ = case.run(reference)
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


def test_nan_in_unowned_slots_is_detected():
    """Guard for this file's method: reading an unowned slot really does surface as a failure."""
    case = Case([4], [1], HEAD_SHAPES[0], 4, seed=5)  # 5 tokens: the second block has 3 unowned slots
    case.meta.seq_lens_host[0] += 1  # claim one slot more than the request owns
    with pytest.raises(AssertionError):
        out, _, _ = case.run(reference)
        assert torch.isfinite(out).all()
