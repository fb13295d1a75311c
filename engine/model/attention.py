"""Plugs kvloom's paged attention into stock transformers model classes.

transformers looks attention functions up by name in `AttentionInterface` and passes extra
forward kwargs through to them, so the runner hands each forward a `ForwardContext` (the
step's metadata and the per-layer caches) and every layer writes its new K/V into the paged
cache and attends over it. No mask is materialized: the causal rule lives in the kernels.
"""

from dataclasses import dataclass

import torch

from kvloom.engine.lora.lora_step import NO_LORA, LoRAStep
from kvloom.kernels.backends import AttentionBackend
from kvloom.kernels.metadata import AttentionMetadata

ATTENTION_NAME = "kvloom_paged"


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key_cache, value_cache)
    backend: AttentionBackend
    lora: LoRAStep = NO_LORA  # the LoRA deltas kvloom's fused decoder adds to its linears


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    kvloom_context: ForwardContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query/key/value arrive as [1, heads, T, head_dim]; returns [1, T, heads, head_dim]."""
    if kvloom_context is None:
        raise RuntimeError("kvloom paged attention called outside a kvloom forward")
    ctx = kvloom_context
    key_cache, value_cache = ctx.kv_caches[module.layer_idx]
    ctx.backend.write_kv(
        key_cache, value_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.meta.slot_mapping
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ctx.backend.paged_attention(query[0].transpose(0, 1), key_cache, value_cache, ctx.meta, scale)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Idempotent: registering the same function under the same name twice is harmless."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
