"""Triton paged attention: the fast path behind the same API as `kernels/reference.py`.

Why: the reference loops over requests on the host and gathers each request's KV into dense
tensors, which costs a copy of the whole context per step. These kernels read the paged cache in
place, so one launch serves a whole mixed batch (prefill chunks with cached prefixes and decodes).

Design (in the style of vLLM's triton "unified attention"):
- `write_kv`: one program per new token scatters its [kv_heads, head_dim] K/V rows into the cache
  slot from `slot_mapping`; slot -1 marks padding and is skipped.
- `paged_attention`: grid (query tile, kv head, KV segment). A program takes BLOCK_Q query tokens
  of one request times every query head sharing that kv head (GQA), i.e. BLOCK_M = BLOCK_Q * GROUP
  rows, so each K/V tile is loaded once per group. It walks the request's KV in BLOCK_N tiles,
  translating positions to cache slots through `block_tables`, stops at the tile's causal limit,
  and keeps an fp32 online softmax (exp2 with the scale folded in).
- The query-tile axis is flat over the whole batch: request i's tiles are numbered from
  `query_start_loc[i] // BLOCK_Q + i` on, and a program finds its request by binary search. A
  grid of (request x tiles of the longest query) is mostly idle programs: for 255 decodes and one
  2k-token chunk at BLOCK_Q 16 it is 256 x 128 per kv head, where this one launches
  `T // BLOCK_Q + num_seqs` = 399 (`query_block_bound`): a bound the host knows without reading
  the device; the few spare programs exit at once.
- Split KV (flash-decoding): a decode-only step with few (request x kv head) programs for the SMs,
  e.g. batch-1 SmolLM2 (3 kv heads), also splits each request's KV walk into `kv_segments` runs of
  tiles; each program stores its unnormalised output with its softmax max and sum, and
  `_reduce_segments_kernel` merges them per (token, head). The segment count comes from host
  fields only and each program sizes its run from the device `seq_lens`, so the launch shapes of a
  decode step are fixed by its batch and a captured CUDA graph serves every context length.
"""

import functools

import torch
import triton
import triton.language as tl

from kvloom.kernels.metadata import AttentionMetadata

# Query rows (tokens x heads of one GQA group) per program: small for decode-only batches, where
# each request has one token, larger for prefill so K/V tiles are reused across more rows.
_BLOCK_M_DECODE = 16
_BLOCK_M_PREFILL = 64
# Split KV: enough segments for this many programs per SM, at most this many segments, each of at
# least one BLOCK_N tile. Reasoned defaults, not yet tuned on a GPU.
_PROGRAMS_PER_SM = 2
_MAX_SEGMENTS = 128
# What the interpreter pretends to have, so that small test batches split their KV too.
_INTERPRETER_SMS = 8
# Decided when the kernels below are decorated, exactly like `@triton.jit` itself does.
_INTERPRETED = triton.knobs.runtime.interpret
# Operand dtype of both matmuls: the cache's own (fp16/bf16 hit tensor cores), accumulation is fp32.
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Copy token `program_id(0)`'s K and V rows into its cache slot (unless the slot is -1)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new tokens' K/V ([T, kv_heads, head_dim]) in their cache slots; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key_cache, value_cache, key, value):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    # A narrower cache (kv_cache_dtype) rounds here, with torch's round-to-nearest-even: the
    # interpreter's bfloat16 cast truncates, and only the new tokens' rows are copied.
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        key_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning flat query tile `q_block`: the last i with
    query_start_loc[i] // BLOCK_Q + i <= q_block.

    Those starts rise by at least cdiv(q_len_i, BLOCK_Q) from one request to the next, so every
    request gets a run of tile numbers long enough for its tokens."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    num_heads,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Causal attention for BLOCK_Q tokens of one request x the GROUP heads of one kv head, over
    segment `program_id(2)` of NUM_SEGMENTS equal runs of the KV tiles those tokens see.

    One segment: the normalised output goes to `out`. More: the unnormalised output, the softmax
    max (log2 domain) and sum go to the partial buffers, row (token * num_heads + head) *
    NUM_SEGMENTS + segment, for `_reduce_segments_kernel`. Splitting is only asked of decode steps,
    whose one token sees every KV position, so each row sees every position of its segment."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = q_block - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the tile is query token q_tile * BLOCK_Q + r // GROUP_PAD, head r % GROUP_PAD of
    # the group; padded heads (GROUP < GROUP_PAD) and tokens past q_len are masked out.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + q_idx  # absolute position of each row's token
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim

    token = (q_start + q_idx).to(tl.int64)
    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offsets, mask=io_mask, other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The last valid token of this tile sees KV positions < kv_end; nothing past it is read. This
    # program walks its segment's share [kv_lo, kv_hi) of those positions (maybe none of them).
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    segment_len = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SEGMENTS) * BLOCK_N
    kv_lo = segment * segment_len
    kv_hi = tl.minimum(kv_lo + segment_len, kv_end)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kv_start in range(kv_lo, kv_hi, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_mask = kv_pos < kv_hi
        block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        k_offsets = (
            block[None, :] * stride_kcb
            + in_block[None, :] * stride_kcs
            + kv_head * stride_kch
            + dims[:, None]
        )  # [BLOCK_D, BLOCK_N]: K already transposed for q @ k
        v_offsets = (
            block[:, None] * stride_vcb
            + in_block[:, None] * stride_vcs
            + kv_head * stride_vch
            + dims[None, :]
        )  # [BLOCK_N, BLOCK_D]
        k_mask = dim_mask[:, None] & kv_mask[None, :]
        v_mask = kv_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + k_offsets, mask=k_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(value_cache_ptr + v_offsets, mask=v_mask, other=0.0).to(DOT_DTYPE)

        # "ieee" keeps fp32 caches exact (tf32 would cost ~1e-3); fp16/bf16 use tensor cores anyway.
        s = tl.dot(q, k, input_precision="ieee") * qk_scale  # log2 domain
        causal = (kv_pos[None, :] <= q_pos[:, None]) & kv_mask[None, :]
        s = tl.where(causal, s, float("-inf"))

        # Every row sees the walk's first position (0 unsplit, or a decode row's segment start) in
        # the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / l_i[:, None]
        o_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        partial = (token * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(partial_max_ptr + partial, m_i, mask=row_mask)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_mask)
        tl.store(partial_out_ptr + partial[:, None] * head_dim + dims[None, :], acc, mask=io_mask)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    head_dim,
    NUM_SEGMENTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the NUM_SEGMENTS partial softmaxes of token `program_id(0)`, head `program_id(1)`.

    A segment the walk never reached has max -inf, hence weight 0; the first one always has
    tiles."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    partial = (token * num_heads + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim

    seg_max = tl.load(partial_max_ptr + partial)
    weight = tl.math.exp2(seg_max - tl.max(seg_max, axis=0))
    total = tl.sum(tl.load(partial_sum_ptr + partial) * weight, axis=0)
    acc_offsets = partial[:, None] * head_dim + dims[None, :]
    acc = tl.load(partial_out_ptr + acc_offsets, mask=dim_mask[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    o_offsets = token * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def query_block_bound(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs along the flat query-tile axis: `num_tokens // block_q + num_seqs`.

    An upper bound on the tiles the batch has (the sum of cdiv(query_len, block_q)), by fewer than
    num_seqs, computed from host ints alone: no sync, and fixed for a captured decode graph."""
    return num_tokens // block_q + num_seqs


def kv_segments(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int,
) -> int:
    """Runs each request's KV walk splits into: 1 (no split) unless the step is decode-only and its
    num_seqs x num_kv_heads programs are fewer than `_PROGRAMS_PER_SM` an SM; then the power of two
    that reaches that many programs, capped so that a segment of the longest request holds at least
    one BLOCK_N tile, and at `_MAX_SEGMENTS`."""
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = triton.next_power_of_2(triton.cdiv(_PROGRAMS_PER_SM * num_sms, programs))
    tiles = triton.cdiv(max_seq_len, block_n)
    return min(wanted, 1 << (tiles.bit_length() - 1), _MAX_SEGMENTS)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The SMs a launch should fill (on the interpreter, a pretend few)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries [T, heads, head_dim] over the paged cache."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    for t in (query, key_cache, value_cache):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = _BLOCK_M_DECODE if meta.max_query_len == 1 else _BLOCK_M_PREFILL
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    block_d = max(16, triton.next_power_of_2(head_dim))
    # KV positions per inner step (a tile may span cache blocks) and warps: sized so that the
    # tiles stay in registers on sm_90 (ptxas shows no spills for fp16/bf16, head_dim 32-128).
    block_n = 64 if block_d * key_cache.element_size() <= 128 else 32
    num_warps = 8 if block_m * block_d >= 8192 else 4
    dot_dtype = _DOT_DTYPES[key_cache.dtype]
    if _INTERPRETED and key_cache.dtype == torch.bfloat16:
        # The CPU interpreter keeps bf16 as raw uint16 bits and would matmul those integers.
        dot_dtype = tl.float32
    segments = kv_segments(
        meta.num_seqs,
        num_kv_heads,
        meta.max_query_len,
        meta.max_seq_len,
        block_n,
        _num_sms(query.device),
    )
    # Unsplit, the kernel writes `out` and never touches the partial buffers (`out` stands in).
    partial_out = partial_max = partial_sum = out
    if segments > 1:
        shape = (num_tokens, num_heads, segments)
        partial_out = query.new_empty((*shape, head_dim), dtype=torch.float32)
        partial_max = query.new_empty(shape, dtype=torch.float32)
        partial_sum = query.new_empty(shape, dtype=torch.float32)
    grid = (query_block_bound(num_tokens, meta.num_seqs, block_q), num_kv_heads, segments)
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        partial_out,
        partial_max,
        partial_sum,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.num_seqs,
        num_heads,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_tables.stride(0),
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        NUM_SEGMENTS=segments,
        DOT_DTYPE=dot_dtype,
        num_warps=num_warps,
    )
    if segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_heads,
            out.stride(0),
            out.stride(1),
            head_dim,
            NUM_SEGMENTS=segments,
            BLOCK_D=block_d,
        )
    return out
