"""Pure-torch paged attention: the oracle every fast path is tested against.

Written for clarity, not speed: one request at a time, explicit causal mask, float32 math.
Cache layout (all implementations): `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

import torch

from kvloom.kernels.metadata import AttentionMetadata


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots.

    index_copy_, not `cache[slots] = key`: with the strided K/V views attention hands us, the
    indexing assignment takes a slow path (~200x slower on CPU, measured).
    """
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)  # the cache may be narrower
    key_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached tokens of one request, as [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries [T, heads, head_dim] over the paged cache."""
    num_heads = query.shape[1]
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty_like(query)
    for i in range(meta.num_seqs):
        start = int(meta.query_start_loc[i])
        q_len = meta.query_lens[i]
        seq_len = meta.seq_lens_host[i]
        q = query[start : start + q_len].float()  # [q, H, D]
        k = gather_kv(key_cache, meta.block_tables[i], seq_len).float()  # [S, Hkv, D]
        v = gather_kv(value_cache, meta.block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start : start + q_len] = torch.einsum("hqs,shd->qhd", probs, v).to(query.dtype)
    return out
