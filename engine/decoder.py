"""kvloom's own forward pass over a stock Llama-family model's weights.

The transformers forward runs ~40 small torch ops per layer; at small batches their dispatch
costs as much as the math, and at large ones the unfused elementwise chains (RMSNorm, rotary,
SiLU-and-multiply) stream the activations through memory again and again. This decoder runs the
same math as one QKV GEMM, one gate|up GEMM, fused RMSNorm, in-place rotary and a fused
SiLU-and-multiply per layer. The weights are concatenated once and the stock modules' parameters
become views of the fused tensors, so nothing is held twice (the sources' pages are released as
each layer is fused, so even the peak holds one extra layer) and the stock model stays usable.

Architectures whose layers do more (Qwen3's per-head q/k norms, biased output or MLP projections,
activations other than SiLU) keep the stock forward: `FusedDecoder.build` returns None for them.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.engine.attention import ForwardContext
from kvloom.engine.host_memory import release_pages
from kvloom.kernels.fused_ops import fused_extension, rotary_embedding_, silu_and_mul

FUSABLE_TYPES = {"llama", "mistral", "qwen2"}


@dataclass
class FusedLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


def _fuse(linears: list[torch.nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the linears' weights (or biases) and make each module's parameter a view of the result."""
    parts = [getattr(m, attr) for m in linears]
    if all(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for module, part in zip(linears, parts):
        setattr(module, attr, torch.nn.Parameter(fused[start : start + part.shape[0]], requires_grad=False))
        release_pages(part)
        start += part.shape[0]
    return fused


def fusable(model) -> bool:
    cfg = model.config
    layer = model.base_model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return (cfg.model_type in FUSABLE_TYPES and getattr(cfg, "hidden_act", "silu") == "silu"
            and attn.o_proj.bias is None and mlp.gate_proj.bias is None and mlp.down_proj.bias is None
            and not hasattr(attn, "q_norm") and getattr(cfg, "pretraining_tp", 1) == 1)


class FusedDecoder:
    """hidden states = FusedDecoder(model)(input_ids [T], positions [T], context)."""

    def __init__(self, model) -> None:
        base = model.base_model
        cfg = model.config
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scale = attn.scaling
        self.hidden_size = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.final_norm = base.norm.weight
        if self.embed.device.type == "cpu":
            fused_extension()  # build (once per machine) now rather than inside the first step
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(FusedLayer(
                input_norm=layer.input_layernorm.weight,
                qkv=_fuse([a.q_proj, a.k_proj, a.v_proj], "weight"),
                qkv_bias=_fuse([a.q_proj, a.k_proj, a.v_proj], "bias"),
                o_proj=a.o_proj.weight,
                post_attention_norm=layer.post_attention_layernorm.weight,
                gate_up=_fuse([m.gate_proj, m.up_proj], "weight"),
                down=m.down_proj.weight,
            ))

    @classmethod
    def build(cls, model) -> "FusedDecoder | None":
        return cls(model) if fusable(model) else None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        residual = F.embedding(input_ids, self.embed)
        cos, sin = (t[0].contiguous() for t in self.rotary(residual, positions[None]))
        meta, backend = context.meta, context.backend
        for layer, (key_cache, value_cache) in zip(self.layers, context.kv_caches):
            qkv = F.linear(self._norm(residual, layer.input_norm), layer.qkv, layer.qkv_bias)
            rotary_embedding_(qkv, cos, sin, heads + kv_heads, head_dim)
            q, k, v = qkv.split(split, dim=-1)
            k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
            backend.write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
            out = backend.paged_attention(q.view(num_tokens, heads, head_dim), key_cache, value_cache, meta,
                                          self.scale)
            residual = residual + F.linear(out.reshape(num_tokens, -1), layer.o_proj)
            gate_up = F.linear(self._norm(residual, layer.post_attention_norm), layer.gate_up)
            residual = residual + F.linear(silu_and_mul(gate_up), layer.down)
        return self._norm(residual, self.final_norm)
