"""The Triton kernels must agree with the pure-torch oracle in `kernels/reference.py`.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors. In
triton 3.9 `@triton.jit` picks interpreter or compiler when it decorates (it reads
`knobs.runtime.interpret`, i.e. the env var, at that moment), and triton's own helpers such as
`tl.zeros`/`tl.max` are decorated when `triton` is first imported. So the flag only works if it is
set before the first `import triton` in the process: this module sets it before importing triton.
If something imported triton earlier without it (another test module, a plugin), these tests are
skipped here and `test_whole_file_in_a_fresh_interpreter_process` re-runs this file in a new
process with the flag set.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

import kvloom.kernels.triton_attention as triton_attention  # noqa: E402
from kvloom.kernels import reference  # noqa: E402
from kvloom.kernels.metadata import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

pytestmark = pytest.mark.triton_kernels  # conftest.py: CUDA, Triton's interpreter, or a fresh process


def test_whole_file_in_a_fresh_interpreter_process(rerun_in_fresh_interpreter):
    rerun_in_fresh_interpreter(__file__)


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random queries and a paged cache holding every request's first `seq_len` tokens.

    Physical blocks are drawn from a shuffled pool larger than needed, so block tables are ragged
    and non-contiguous. Every slot not holding a live token is NaN: a kernel that reads past a
    request's `seq_len` or into a foreign block poisons its output.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in blocks_needed:
        tables.append(pool[:n])
        pool = pool[n:]

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    for table, seq_len in zip(tables, seq_lens):
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, device=DEVICE)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim, device=DEVICE)

    query = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=DEVICE)
    return query, key_cache, value_cache, meta


def assert_attention_matches_reference(query_lens: list[int], seq_lens: list[int], **kwargs):
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, **kwargs)
    scale = query.shape[-1] ** -0.5
    expected = reference.paged_attention(query, key_cache, value_cache, meta, scale)
    actual = triton_attention.paged_attention(query, key_cache, value_cache, meta, scale)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "kernel read a slot outside the live KV"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[query.dtype])


class LaunchSpy:
    """Stands in for a kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch) -> list[tuple[int, int, int]]:
    """The grids `paged_attention` launches its attention kernel with, in this test."""
    spy = LaunchSpy(triton_attention._paged_attention_kernel)
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", spy)
    return spy.grids


def pretend_sms(monkeypatch, num_sms: int) -> None:
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: num_sms)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_prefill_chunk_over_cached_prefix_spanning_several_blocks(head_dim):
    # 40 new tokens after an 80-token prefix (5 blocks): the KV walk takes several tiles and the
    # chunk splits into query tiles (16 tokens x 4 heads each) with different causal limits.
    assert_attention_matches_reference([40], [120], num_heads=8, head_dim=head_dim)


def test_fresh_prefill_is_causal_from_position_zero():
    assert_attention_matches_reference([37], [37], num_heads=4, num_kv_heads=1)


@pytest.mark.parametrize("num_sms, split", [(1, False), (132, True)], ids=["whole-kv", "split-kv"])
def test_pure_decode_batch_with_ragged_contexts(num_sms, split, monkeypatch, launches):
    pretend_sms(monkeypatch, num_sms)
    assert_attention_matches_reference([1, 1, 1, 1], [1, 17, 40, 130])
    assert (launches[0][2] > 1) == split


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_prefill_and_decode_batch(block_size):
    # fresh prefill, decode, chunk over a prefix, decode at an exact block boundary
    assert_attention_matches_reference(
        [20, 1, 5, 1], [20, 33, 37, 64], num_heads=8, block_size=block_size
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_decodes_beside_a_long_chunk_on_the_flat_grid(dtype, launches):
    # The step in small: 17 decodes and one 40-token chunk over a 25-token cached prefix.
    # A (request, tile of the longest query) grid would launch 18 x 2 programs per kv head.
    query_lens = [1] * 8 + [40] + [1] * 9
    seq_lens = [3, 16, 17, 31, 32, 33, 1, 70] + [65] + [2, 48, 49, 15, 64, 1, 100, 5, 20]
    assert_attention_matches_reference(query_lens, seq_lens, dtype=dtype)
    # 32 tokens a tile (64 rows / 2 query heads per kv head): T // 32 + num_seqs tiles, one segment
    assert launches == [(57 // 32 + 18, 2, 1)]


def test_chunks_with_cached_prefixes_between_decodes():
    # Chunks of several tile counts (binary search lands in gaps of different widths), a fresh
    # prompt, a chunk exactly one tile long and decodes at and off block boundaries.
    query_lens = [1, 33, 1, 1, 16, 7, 1, 64, 1]
    seq_lens = [9, 50, 16, 33, 16, 90, 130, 80, 1]
    assert_attention_matches_reference(query_lens, seq_lens, num_heads=9, num_kv_heads=3)


def test_flat_grid_bounds_the_programs_of_255_decodes_and_a_2k_chunk():
    query_lens = [1] * 255 + [2048]
    for block_q in (1, 2, 4, 8, 16, 32, 64):
        tiles = sum(triton.cdiv(q, block_q) for q in query_lens)
        bound = triton_attention.query_block_bound(sum(query_lens), len(query_lens), block_q)
        assert tiles <= bound <= tiles + len(query_lens)
        per_request_grid = len(query_lens) * triton.cdiv(max(query_lens), block_q)
        assert bound * 20 < per_request_grid  # e.g. 16 query tokens a program: 399 against 32768


def test_kv_segments_fill_132_sms_for_a_small_decode_batch():
    # batch-1 SmolLM2 decode (3 kv heads) over an 8k context on an H200: 3 programs unsplit
    segments = triton_attention.kv_segments(1, 3, 1, 8192, 64, num_sms=132)
    assert segments > 1 and 3 * segments >= 2 * 132
    assert triton_attention.kv_segments(8, 3, 1, 2048, 64, num_sms=132) == 16  # 384 programs
    # a segment keeps at least one tile of the longest request: 100 tokens are 2 tiles
    assert triton_attention.kv_segments(1, 3, 1, 100, 64, num_sms=132) == 2
    assert triton_attention.kv_segments(1, 3, 1, 64, 64, num_sms=132) == 1


def test_kv_segments_leave_full_and_prefill_steps_whole():
    kv_segments = triton_attention.kv_segments
    assert kv_segments(255, 3, 1, 8192, 64, num_sms=132) == 1  # 765 programs already
    assert kv_segments(1, 3, 2048, 8192, 64, num_sms=132) == 1  # a prefill chunk
    assert kv_segments(1, 1, 1, 10**6, 64, num_sms=10**4) == triton_attention._MAX_SEGMENTS


@pytest.mark.parametrize(
    "seq_lens, num_heads, num_kv_heads, dtype",
    [
        ([1, 130, 47], 4, 2, torch.float32),  # a one-token request among ragged ones
        ([16, 17, 200], 9, 3, torch.float32),  # at and past block boundaries; SmolLM2's GQA
        ([1, 1, 33], 4, 1, torch.float32),  # mostly empty segments; MQA
        ([95], 9, 3, torch.bfloat16),
        ([64, 150], 8, 2, torch.float16),
    ],
)
def test_split_kv_decode_matches_reference(
    seq_lens, num_heads, num_kv_heads, dtype, monkeypatch, launches
):
    pretend_sms(monkeypatch, 132)
    assert_attention_matches_reference(
        [1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype
    )
    (grid,) = launches
    assert grid[2] > 1, "the decode step did not split its KV"


@pytest.mark.parametrize(
    "num_heads, num_kv_heads",
    [(8, 2), (9, 3), (4, 4), (4, 1)],
    ids=["gqa-8/2", "gqa-9/3-smollm2", "mha", "mqa"],
)
def test_grouped_query_attention_maps_heads_to_their_kv_head(num_heads, num_kv_heads):
    assert_attention_matches_reference(
        [9, 1, 3], [30, 50, 3], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_accumulate_in_fp32(dtype):
    assert_attention_matches_reference([12, 1], [40, 70], num_heads=9, num_kv_heads=3, dtype=dtype)


def test_empty_batch_returns_empty_output():
    query, key_cache, value_cache, _ = make_batch([1], [1])
    meta = AttentionMetadata.build([], [], [], 16, device=DEVICE)
    out = triton_attention.paged_attention(query[:0], key_cache, value_cache, meta, 0.125)
    assert out.shape == (0, *query.shape[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_rows_in_slots_and_skips_padding(dtype):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim = 4, 16, 3, 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, device=DEVICE).to(dtype)
    value_cache = torch.randn(shape, device=DEVICE).to(dtype)
    # K and V as strided views into one fused projection output, like a real QKV split.
    slot_mapping = torch.tensor([5, 17, -1, 63, 32, -1], device=DEVICE)
    fused = torch.randn(len(slot_mapping), 2, kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = fused[:, 0], fused[:, 1]

    live = slot_mapping >= 0
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.write_kv(expected_k, expected_v, key[live], value[live], slot_mapping[live])
    triton_attention.write_kv(key_cache, value_cache, key, value, slot_mapping)

    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_write_then_attend_matches_reference_step():
    # One engine step: store the new tokens' K/V, then attend over prefix + new tokens.
    query_lens, seq_lens = [6, 1], [22, 9]
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, num_heads=8)
    new_k = torch.randn(sum(query_lens), *key_cache.shape[2:], device=DEVICE)
    new_v = torch.randn_like(new_k)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.write_kv(ref_k, ref_v, new_k, new_v, meta.slot_mapping)
    triton_attention.write_kv(key_cache, value_cache, new_k, new_v, meta.slot_mapping)

    scale = query.shape[-1] ** -0.5
    expected = reference.paged_attention(query, ref_k, ref_v, meta, scale)
    actual = triton_attention.paged_attention(query, key_cache, value_cache, meta, scale)
    torch.testing.assert_close(actual, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_float32_queries_over_a_narrow_cache(cache_dtype):
    """kv_cache_dtype: float32 K/V are rounded into a half-precision cache and attended by float32 queries."""
    query_lens, seq_lens = [6, 1], [22, 9]
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, num_heads=8, dtype=cache_dtype)
    query = query.float()
    new_k = torch.randn(sum(query_lens), *key_cache.shape[2:], device=DEVICE)
    new_v = torch.randn_like(new_k)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.write_kv(ref_k, ref_v, new_k, new_v, meta.slot_mapping)
    triton_attention.write_kv(key_cache, value_cache, new_k, new_v, meta.slot_mapping)
    torch.testing.assert_close(key_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, ref_v, atol=0, rtol=0, equal_nan=True)

    scale = query.shape[-1] ** -0.5
    expected = reference.paged_attention(query, ref_k, ref_v, meta, scale)
    actual = triton_attention.paged_attention(query, key_cache, value_cache, meta, scale)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, **TOLERANCE[cache_dtype])  # the dot runs in the cache's dtype
