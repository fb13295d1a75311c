"""CPU fast path: C++ paged kernels for decode rows and prompt chunks, torch fallbacks for both.

Decode rows (one query token) dominate steady-state serving and are memory-bound: the C++
kernel (cpu_decode.cpp, built once per machine with torch's JIT extension loader) reads K/V
straight from the blocks with SIMD dot products and an online softmax, about 20x faster than
gathering them into a padded batch for SDPA (measured at batch 64, context 256). Prompt chunks are
compute-bound: cpu_prefill.cpp takes every chunk of the step in one call and scores only the keys at
or before each query (torch's CPU flash attention computes the whole square under a causal mask).
Where a kernel cannot be built, for float16 queries, or for head shapes it was not compiled for,
decode falls back to one gathered, masked SDPA call and each prompt chunk to its own causal SDPA
call over its cached prefix. The cache may be narrower than the model (`kv_cache_dtype`): the
kernels widen float16/bfloat16 rows as they read them.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension
from kvloom.kernels.metadata import AttentionMetadata
from kvloom.kernels import reference
from kvloom.kernels.reference import gather_kv

__all__ = ["write_kv", "paged_attention", "decode_extension", "prefill_extension"]
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the C++ kernels read
QUERY_DTYPES = (torch.float32, torch.bfloat16)  # its math is float32 either way


def decode_extension():
    """The compiled decode kernel, or None where it cannot be built."""
    return build_extension("kvloom_cpu_decode")


def prefill_extension():
    """The compiled prompt-chunk kernel, or None where it cannot be built."""
    return build_extension("kvloom_cpu_prefill")


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The oracle's store, in one C++ call where K/V already have the cache's dtype (two index_copy_ otherwise)."""
    ext = decode_extension()
    if ext is not None and key.dtype == key_cache.dtype and value.dtype == value_cache.dtype:
        ext.write_kv(key_cache, value_cache, key, value, slot_mapping)
    else:
        reference.write_kv(key_cache, value_cache, key, value, slot_mapping)


def _decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Fallback: gather every decode request's blocks into one padded, masked SDPA call."""
    block_size = key_cache.shape[1]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    tables = tables[:, :num_blocks].long()
    batch = len(seq_lens)
    keys = key_cache[tables].view(batch, num_blocks * block_size, *key_cache.shape[2:]).to(q.dtype)
    values = value_cache[tables].view(batch, num_blocks * block_size, *value_cache.shape[2:]).to(q.dtype)
    lengths = torch.tensor(seq_lens).unsqueeze(1)
    valid = torch.arange(num_blocks * block_size).unsqueeze(0) < lengths  # [B, S]
    # slots past a request's context (its last block's tail, padded table entries) hold stale data
    # of other requests, possibly inf/NaN; a masked score still multiplies its value (0 * inf = NaN)
    keys.masked_fill_(~valid[:, :, None, None], 0)
    values.masked_fill_(~valid[:, :, None, None], 0)
    mask = valid.view(batch, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
    seq_len: int, scale: float,
) -> torch.Tensor:
    q_len = query.shape[0]
    keys = gather_kv(key_cache, table, seq_len).to(query.dtype).transpose(0, 1).unsqueeze(0)
    values = gather_kv(value_cache, table, seq_len).to(query.dtype).transpose(0, 1).unsqueeze(0)
    q = query.transpose(0, 1).unsqueeze(0)
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@dataclass
class _StepPlan:
    """Per-step work split, computed once and shared by every layer."""

    decode_rows: torch.Tensor  # query rows of one-token requests
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    decode_lens_host: list[int]
    prefills: list[tuple[int, int, int]]  # (request index, first row, query length)
    prefill_starts: list[int]  # each prompt chunk's first query row
    prefill_tables: torch.Tensor
    prefill_lens: list[int]
    prefill_seq_lens: list[int]


def _plan(meta: AttentionMetadata) -> _StepPlan:
    plan = meta.derived.get("cpu")
    if plan is None:
        starts = meta.query_start_loc.tolist()
        decodes = [i for i, q_len in enumerate(meta.query_lens) if q_len == 1]
        chunks = [i for i, q_len in enumerate(meta.query_lens) if q_len > 1]
        index = torch.tensor(decodes, dtype=torch.long)
        plan = _StepPlan(
            decode_rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long),
            decode_tables=meta.block_tables[index],
            decode_lens=meta.seq_lens[index],
            decode_lens_host=[meta.seq_lens_host[i] for i in decodes],
            prefills=[(i, starts[i], meta.query_lens[i]) for i in chunks],
            prefill_starts=[starts[i] for i in chunks],
            prefill_tables=meta.block_tables[torch.tensor(chunks, dtype=torch.long)],
            prefill_lens=[meta.query_lens[i] for i in chunks],
            prefill_seq_lens=[meta.seq_lens_host[i] for i in chunks],
        )
        meta.derived["cpu"] = plan
    return plan


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    plan = _plan(meta)
    ext = decode_extension() if query.dtype in QUERY_DTYPES and key_cache.dtype in CACHE_DTYPES else None
    if ext is not None and not ext.paged_decode_supported(query.shape[-1], query.shape[1] // key_cache.shape[2]):
        ext = None
    if ext is not None and not plan.prefills:  # a decode step: the kernel reads the query rows where they are
        return ext.paged_decode(query, key_cache, value_cache, plan.decode_tables, plan.decode_lens, scale)
    out = torch.empty(query.shape, dtype=query.dtype)
    if plan.decode_lens_host:
        q = query.index_select(0, plan.decode_rows)
        if ext is not None:
            decoded = ext.paged_decode(q, key_cache, value_cache, plan.decode_tables, plan.decode_lens, scale)
        else:
            decoded = _decode(q, key_cache, value_cache, plan.decode_tables, plan.decode_lens_host, scale)
        out.index_copy_(0, plan.decode_rows, decoded)
    if plan.prefills:
        ext = prefill_extension() if query.dtype in QUERY_DTYPES and key_cache.dtype in CACHE_DTYPES else None
        if ext is not None and ext.prefill_supported(query.shape[-1]):
            _prefill_chunks(ext, query, key_cache, value_cache, plan, scale, out)
        else:
            for i, start, q_len in plan.prefills:
                out[start : start + q_len] = _prefill(query[start : start + q_len], key_cache, value_cache,
                                                      meta.block_tables[i], meta.seq_lens_host[i], scale)
    return out


def _prefill_chunks(ext, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: _StepPlan, scale: float, out: torch.Tensor) -> None:
    """Every prompt chunk of the step through the C++ kernel: one call, reading the query rows where they are
    and writing the chunks' rows of `out`."""
    ext.paged_prefill(query, out, key_cache, value_cache, plan.prefill_tables, plan.prefill_starts,
                      plan.prefill_lens, plan.prefill_seq_lens, scale)
