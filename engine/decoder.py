"""kvloom's own forward pass over a stock Llama-family model's weights.

The transformers forward runs ~40 small torch ops per layer; at small batches their dispatch
costs as much as the math, and at large ones the unfused elementwise chains (RMSNorm, rotary,
SiLU-and-multiply) stream the activations through memory again and again. This decoder runs the
same math as one QKV GEMM, one gate|up GEMM, residual-add fused with RMSNorm, in-place rotary
and SiLU-and-multiply per layer, with every weight packed once for oneDNN on CPU (`PackedLinear`:
1.5-2x MKL's GEMM at decode batch sizes).

The decoder takes the layers' weights over: as each layer is packed, the stock layer's sources
are released and the stock layers are deleted at the end, so nothing is held twice (the peak
holds one extra layer) and a stray call of the stock forward fails loudly instead of reading
released weights. An untied LM head is packed too; a head tied to the embedding table runs oneDNN on
the table itself. A packed copy would be ~10% faster, but the lookup reads the dense table: releasing
its pages does not keep them out (the kernel maps a whole page-cache folio back on each touch; a
few thousand distinct tokens bring back nearly all of it), so the copy would cost the table's size.

Architectures whose layers do more (Qwen3's per-head q/k norms, biased output or MLP projections,
activations other than SiLU) keep the stock forward: `FusedDecoder.build` returns None for them.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.engine.attention import ForwardContext
from kvloom.engine.host_memory import release_pages
from kvloom.kernels.fused_ops import add_rms_norm_, fused_extension, rotary_embedding_, silu_and_mul
from kvloom.kernels.packed_linear import PackedLinear

FUSABLE_TYPES = {"llama", "mistral", "qwen2"}
MLP_ROWS = 512  # rows per MLP pass (see FusedDecoder._mlp)


@dataclass
class FusedLayer:
    input_norm: torch.Tensor
    qkv: PackedLinear  # [(H + 2 KVH) * D, hidden]
    o_proj: PackedLinear
    post_attention_norm: torch.Tensor
    gate_up: PackedLinear  # [2 * intermediate, hidden]
    down: PackedLinear


def _pack(linears: list[torch.nn.Linear]) -> PackedLinear:
    """One packed linear computing the given ones side by side; their weights are released after."""
    weights = [m.weight.detach() for m in linears]
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])
    packed = PackedLinear.pack(torch.cat(weights) if len(weights) > 1 else weights[0], bias)
    if packed.packed or len(weights) > 1:  # the sources are dead weight now (the stock layers are deleted below)
        for w in weights:
            release_pages(w)
    return packed


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
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=_pack([a.q_proj, a.k_proj, a.v_proj]),
                o_proj=_pack([a.o_proj]),
                post_attention_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=_pack([m.gate_proj, m.up_proj]),
                down=_pack([m.down_proj]),
            ))
        del base.layers  # their weights now live (packed) in self.layers only
        head = model.get_output_embeddings()
        tied = head.weight.data_ptr() == self.embed.data_ptr()
        self.lm_head = (PackedLinear.share if tied else PackedLinear.pack)(head.weight, head.bias)

    @classmethod
    def build(cls, model) -> "FusedDecoder | None":
        return cls(model) if fusable(model) else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        residual = F.embedding(input_ids, self.embed)  # a fresh tensor: the residual stream, updated in place
        cos, sin = (t[0].contiguous() for t in self.rotary(residual, positions[None]))
        meta, backend = context.meta, context.backend
        # each sublayer's output joins the residual in the same pass that normalizes it for the next one
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        hidden = add_rms_norm_(residual, None, self.layers[0].input_norm, self.eps)
        for layer, next_norm, (key_cache, value_cache) in zip(self.layers, next_norms, context.kv_caches):
            qkv = layer.qkv(hidden)
            rotary_embedding_(qkv, cos, sin, heads + kv_heads, head_dim)
            q, k, v = qkv.split(split, dim=-1)
            k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
            backend.write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
            out = backend.paged_attention(q.view(num_tokens, heads, head_dim), key_cache, value_cache, meta,
                                          self.scale)
            hidden = add_rms_norm_(residual, layer.o_proj(out.reshape(num_tokens, -1)), layer.post_attention_norm,
                                   self.eps)
            hidden = self._mlp(layer, hidden, residual, next_norm)
        return hidden

    def _mlp(self, layer: FusedLayer, hidden: torch.Tensor, residual: torch.Tensor, next_norm: torch.Tensor):
        """The MLP, joined to the residual and normalized for the next sublayer, MLP_ROWS rows at a time.

        Rows are independent here, and a prefill step's intermediates at full width (2048 rows: 25 MB
        for gate|up, 12 MB after SiLU-and-multiply) would fall out of cache between the GEMM and the
        elementwise pass, and add to the process's peak memory.
        """
        chunks = []
        for i in range(0, hidden.shape[0], MLP_ROWS):
            rows = slice(i, i + MLP_ROWS)
            mlp_out = layer.down(silu_and_mul(layer.gate_up(hidden[rows])))
            chunks.append(add_rms_norm_(residual[rows], mlp_out, next_norm, self.eps))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
