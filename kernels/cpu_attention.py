"""CPU fast path: batched decode over gathered blocks, per-request SDPA for prefill chunks.

Decode rows (one query token) of the whole batch share one gather and one fused
scaled-dot-product call, padded to the longest context and masked; prefill chunks are few per
step and compute-heavy, so each gets its own causal SDPA call over its cached prefix.
"""

import torch
import torch.nn.functional as F

from kvloom.kernels.metadata import AttentionMetadata
from kvloom.kernels.reference import gather_kv, write_kv

__all__ = ["write_kv", "paged_attention"]


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: list[int],
    tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    block_size = key_cache.shape[1]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    tables = tables[:, :num_blocks].long()
    batch = len(rows)
    keys = key_cache[tables].view(batch, num_blocks * block_size, *key_cache.shape[2:])
    values = value_cache[tables].view(batch, num_blocks * block_size, *value_cache.shape[2:])
    lengths = torch.tensor(seq_lens).unsqueeze(1)
    valid = torch.arange(num_blocks * block_size).unsqueeze(0) < lengths  # [B, S]
    # slots past a request's context (its last block's tail, padded table entries) hold stale data
    # of other requests, possibly inf/NaN; a masked score still multiplies its value (0 * inf = NaN)
    keys.masked_fill_(~valid[:, :, None, None], 0)
    values.masked_fill_(~valid[:, :, None, None], 0)
    mask = valid.view(batch, 1, 1, -1)
    q = query[rows].unsqueeze(2)  # [B, H, 1, D]
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
    seq_len: int, scale: float,
) -> torch.Tensor:
    q_len = query.shape[0]
    keys = gather_kv(key_cache, table, seq_len).transpose(0, 1).unsqueeze(0)
    values = gather_kv(value_cache, table, seq_len).transpose(0, 1).unsqueeze(0)
    q = query.transpose(0, 1).unsqueeze(0)
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    decode_seqs = [i for i, q_len in enumerate(meta.query_lens) if q_len == 1]
    if decode_seqs:
        rows = [starts[i] for i in decode_seqs]
        out[rows] = _decode(
            query, key_cache, value_cache, rows, meta.block_tables[decode_seqs],
            [meta.seq_lens_host[i] for i in decode_seqs], scale,
        )
    for i, q_len in enumerate(meta.query_lens):
        if q_len > 1:
            start = starts[i]
            out[start : start + q_len] = _prefill(
                query[start : start + q_len], key_cache, value_cache, meta.block_tables[i],
                meta.seq_lens_host[i], scale,
            )
    return out
