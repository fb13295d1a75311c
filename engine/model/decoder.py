"""kvloom's own forward pass for Llama-family models, built straight from the checkpoint's tensors.

The transformers forward runs ~40 small torch ops per layer; at small batches their dispatch
costs as much as the math, and at large ones the unfused elementwise chains (RMSNorm, rotary,
SiLU-and-multiply) stream the activations through memory again and again. This decoder runs the
same math as one QKV GEMM, one gate|up GEMM, residual-add fused with RMSNorm, in-place rotary
and SiLU-and-multiply per layer, with every weight laid out once for the CPU kernel that runs it best
(`PackedLinear`: oneDNN's packed GEMM, or on AVX-512 CPUs without AMX kvloom's own blocked kernel).

Under a bfloat16 model the GEMMs, the KV cache and the attention inputs are bfloat16 (AMX tiles on
the CPUs that have them), while the residual stream, the norm weights, the rotary tables and every
reduction stay float32: the residual is the sum of every sublayer's output, where bfloat16 rounding
would accumulate, and at 576 floats per token it costs next to nothing to keep wide.

It reads the safetensors file directly rather than through transformers' model classes, whose import
alone costs ~180 MB per process (see `model_config.py`). Each source weight is released as soon as it is
packed, so nothing is held twice. An untied LM head is packed too. A head tied to the embedding table gets a
packed copy in bfloat16, or where kvloom's blocked kernel runs every linear (a step's GEMMs all on kvloom's own
threads; the copy costs the table's size: the lookup reads the dense table, and releasing its pages does not keep
them out, as the kernel maps a whole page-cache folio back on each touch). In float32 under oneDNN it runs oneDNN
on the table itself, at ~90% of a packed copy's speed.

Architectures whose layers do more (Qwen3's per-head q/k norms, biased output or MLP projections,
activations other than SiLU, length-dependent RoPE) keep the stock forward: `FusedDecoder.unsupported`
says why.
"""

from dataclasses import dataclass

import logging

import torch

from kvloom.engine.model.attention import ForwardContext
from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.model.decode_stack import DecodeStack
from kvloom.engine.host_memory import release_pages
from kvloom.engine.lora.lora_step import LoRAStep
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.rotary import RotaryEmbedding, unsupported_rope
from kvloom.engine.tensor_parallel.tp_group import SingleDevice, TensorParallelGroup
from kvloom.kernels.fp8_linear import Fp8Linear, runs_in_fp8
from kvloom.kernels.fused_ops import add_rms_norm_, fused_extension, rotary_embedding_, silu_and_mul
from kvloom.engine.model.quantized_weights import BlockSource
from kvloom.kernels.packed_linear import Layout, PackedLinear, host_layout
from kvloom.kernels.quantized_linear import QuantizedLinear

FUSABLE_TYPES = {"llama", "mistral", "qwen2"}
logger = logging.getLogger(__name__)
MLP_ROWS = 512  # rows per MLP pass (see FusedDecoder._mlp)


@dataclass
class FusedLayer:
    input_norm: torch.Tensor
    qkv: PackedLinear  # [(H + 2 KVH) * D, hidden]
    o_proj: PackedLinear
    post_attention_norm: torch.Tensor
    gate_up: PackedLinear  # [2 * intermediate, hidden]
    down: PackedLinear


class FusedDecoder:
    """hidden states = FusedDecoder(...)(input_ids [T], positions [T], context); logits(hidden)."""

    def __init__(self, config: ModelConfig, checkpoint: Checkpoint,
                 group: SingleDevice | TensorParallelGroup = SingleDevice(),
                 quantized: BlockSource | None = None, fp8: bool = False) -> None:
        """`config` and `checkpoint` as this rank sees them: a tensor-parallel rank's heads, MLP width and
        vocabulary range, with `group` reducing its partial sums (see tp_shards.py). `quantized`: the GGUF blocks
        the linears run as stored (`quantization: gguf`, an integer checkpoint; one rank); `fp8`: the
        layers' linears in float8 (`quantization: fp8`; the LM head stays in the model's dtype, as vLLM keeps it)."""
        self.group = group
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scale = config.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.rotary = RotaryEmbedding.of(config, checkpoint.device)
        if checkpoint.device.type == "cpu":
            fused_extension()  # build (once per machine) now rather than inside the first step
        self.dtype = checkpoint.dtype
        self.embed = checkpoint.get("model.embed_tokens.weight")
        norm = lambda name: checkpoint.get(name, torch.float32)  # noqa: E731  (the residual's dtype)
        self.final_norm = norm("model.norm.weight")
        self.layers = []
        linear = lambda names: _pack(checkpoint, names, quantized, fp8)  # noqa: E731
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            self.layers.append(FusedLayer(
                input_norm=norm(f"{prefix}.input_layernorm.weight"),
                qkv=linear([f"{prefix}.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]),
                o_proj=linear([f"{prefix}.self_attn.o_proj"]),
                post_attention_norm=norm(f"{prefix}.post_attention_layernorm.weight"),
                gate_up=linear([f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"]),
                down=linear([f"{prefix}.mlp.down_proj"]),
            ))
        if fp8:
            _log_fp8_misfits(self.layers)
        tied_blocks = quantized.blocks(["model.embed_tokens.weight"]) if quantized is not None else None
        self.head_shares_embedding = (config.tie_word_embeddings and self.dtype == torch.float32 and tied_blocks is None
                                      and host_layout(self.embed) is not Layout.BLOCKED)
        if not config.tie_word_embeddings:
            self.lm_head = _pack(checkpoint, ["lm_head"], quantized)
        elif tied_blocks is not None:  # the table's own blocks: read as stored, the lookup reads the dense table
            int8 = quantized.int8_activations(["model.embed_tokens.weight"])
            self.lm_head = QuantizedLinear.pack(*tied_blocks, self.dtype, device=checkpoint.device, int8=int8)
        elif self.head_shares_embedding:
            self.lm_head = PackedLinear.share(self.embed)
        else:
            self.lm_head = PackedLinear.pack(self.embed)
        # a decode-only step's layers in one C++ call, where every linear runs on the CPU on one device
        self.stack = (DecodeStack.of(self.layers, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
                      if checkpoint.device.type == "cpu" and isinstance(group, SingleDevice) else None)

    @staticmethod
    def unsupported(config: ModelConfig, checkpoint: Checkpoint | None) -> str | None:
        """Why this decoder cannot run the model (the stock forward can), or None if it can."""
        if checkpoint is None:
            return "its weights are not in safetensors files"
        if config.model_type not in FUSABLE_TYPES:
            return f"{config.model_type} layers"
        if "model.layers.0.self_attn.q_norm.weight" in checkpoint:
            return "per-head q/k norms"
        if config.hidden_act != "silu":
            return f"the {config.hidden_act} activation"
        biased = [name for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
                  if f"model.layers.0.{name}.bias" in checkpoint]
        if biased:
            return f"biased {', '.join(biased)}"
        if config.raw.get("pretraining_tp", 1) != 1:
            return "tensor-parallel-split linears (pretraining_tp)"
        if not config.tie_word_embeddings and "lm_head.weight" not in checkpoint:
            return "no lm_head.weight, and the head is not tied to the embedding table"
        return unsupported_rope(config)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                 num_layers: int | None = None, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm; `num_layers`: only the first that many layers run (layer-skip
        drafting: the final norm and the LM head read what they leave). `keep_rows`: the rows the caller reads
        (the LM head's), in order; only theirs come back.

        The last layer writes every row's K/V, but its attention output's projection and its MLP run on the
        kept rows only: nothing reads the others' hidden states. A prompt chunk keeps its last row at most, so
        a prefill step skips ~1/L of its linears' work (2.8% of SmolLM2's 30 layers), as llama.cpp does."""
        num_tokens = input_ids.shape[0]
        layers = self.layers[:num_layers]
        if keep_rows is not None and len(keep_rows) == num_tokens:
            keep_rows = None  # every row (rows are kept in order, once each)
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        # a fresh float32 tensor: the residual stream, updated in place
        residual = self.group.embed(input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(positions)
        dtype, eps = self.dtype, self.eps
        meta, backend, lora = context.meta, context.backend, context.lora
        hidden = add_rms_norm_(residual, None, layers[0].input_norm, eps, dtype)
        if self.stack is not None and keep_rows is None and self.stack.runs(context, num_tokens, MLP_ROWS):
            return self.stack(residual, hidden, cos, sin, context, len(layers), self.final_norm, self.scale, eps)
        # each sublayer's output joins the residual in the same pass that normalizes it for the next one
        next_norms = [layer.input_norm for layer in layers[1:]] + [self.final_norm]
        last = len(layers) - 1
        for i, (layer, next_norm, (key_cache, value_cache)) in enumerate(zip(layers, next_norms, context.kv_caches)):
            qkv = layer.qkv(hidden)
            lora.add(i, "qkv", hidden, qkv)
            rotary_embedding_(qkv, cos, sin, heads + kv_heads, head_dim)
            q, k, v = qkv.split(split, dim=-1)
            k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
            backend.write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
            if i == last and keep_rows is not None and not len(keep_rows):
                return hidden[:0]  # nothing reads this step's hidden states: the last layer owed its K/V only
            out = backend.paged_attention(q.view(num_tokens, heads, head_dim), key_cache, value_cache, meta,
                                          self.scale)
            if i == last and keep_rows is not None:
                out, residual, lora = out[keep_rows], residual[keep_rows], lora.kept_rows()
            out = out.reshape(out.shape[0], -1)
            attention_out = layer.o_proj(out)
            lora.add(i, "o_proj", out, attention_out)
            hidden = add_rms_norm_(residual, self.group.all_reduce(attention_out), layer.post_attention_norm, eps,
                                   dtype)
            hidden = self._mlp(i, hidden, residual, next_norm, lora)
        return hidden

    def _mlp(self, index: int, hidden: torch.Tensor, residual: torch.Tensor, next_norm: torch.Tensor,
             lora: LoRAStep):
        """Layer `index`'s MLP (LoRA deltas added), joined to the residual and normalized for the next sublayer,
        MLP_ROWS rows at a time.

        Rows are independent here, and a prefill step's intermediates at full width (2048 rows: 25 MB
        for gate|up, 12 MB after SiLU-and-multiply) would fall out of cache between the GEMM and the
        elementwise pass, and add to the process's peak memory.
        """
        layer, chunks = self.layers[index], []
        for first in range(0, hidden.shape[0], MLP_ROWS):
            rows = slice(first, first + MLP_ROWS)
            gate_up = layer.gate_up(hidden[rows])
            lora.add(index, "gate_up", hidden[rows], gate_up, first)
            activated = silu_and_mul(gate_up)
            mlp_out = layer.down(activated)
            lora.add(index, "down", activated, mlp_out, first)
            chunks.append(add_rms_norm_(residual[rows], self.group.all_reduce(mlp_out), next_norm, self.eps,
                                        self.dtype))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def runs_on_own_kernels(self) -> bool:
        """Every linear is kvloom's blocked or quantized GEMM: a CPU step's heavy work is all kvloom's kernels
        (kernels/item_pool.py)."""
        linears = [self.lm_head] + [linear for layer in self.layers
                                    for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return all(linear.layout in (Layout.BLOCKED, Layout.QUANTIZED) for linear in linears)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab]; under tensor parallelism on rank 0 only (None on the others)."""
        return self.group.gather_logits(self.lm_head(hidden))

    def weight_bytes(self) -> int:
        """Bytes of every weight this decoder holds (a shared LM head counted once)."""
        tensors = [self.embed, self.final_norm] + [t for layer in self.layers for t in (
            layer.input_norm, layer.post_attention_norm, *(linear.weight for linear in (
                layer.qkv, layer.o_proj, layer.gate_up, layer.down)))]
        if not self.head_shares_embedding:
            tensors.append(self.lm_head.weight)
        return sum(t.nbytes for t in tensors)  # oneDNN's packed layout: its dense size


def _log_fp8_misfits(layers: list["FusedLayer"]) -> None:
    """One line naming the linears `quantization: fp8` keeps in the model's dtype (dims not multiples of 16)."""
    kept = sorted({name for layer in layers for name in ("qkv", "o_proj", "gate_up", "down")
                   if not isinstance(getattr(layer, name), Fp8Linear)})
    if kept:
        logger.info("quantization fp8: %s keep the model's dtype (float8 GEMMs take dims that are multiples of 16)",
                    ", ".join(kept))


def _pack(checkpoint: Checkpoint, prefixes: list[str], quantized: BlockSource | None = None, fp8: bool = False
          ) -> PackedLinear | QuantizedLinear | Fp8Linear:
    """One linear computing the named ones side by side: from their GGUF blocks where `quantized` holds them in
    a type kvloom runs (and each has a bias, or none has), in float8 where `fp8` and the shape allows, else packed
    from the checkpoint's weights (their sources released after)."""
    biases = [checkpoint.get(f"{p}.bias") if f"{p}.bias" in checkpoint else None for p in prefixes]
    names = [f"{p}.weight" for p in prefixes]
    blocks = quantized.blocks(names) if quantized is not None else None
    if blocks is not None and len({b is None for b in biases}) == 1:
        return QuantizedLinear.pack(*blocks, checkpoint.dtype, None if biases[0] is None else torch.cat(biases),
                                    device=checkpoint.device, int8=quantized.int8_activations(names))
    weights = [checkpoint.get(f"{p}.weight") for p in prefixes]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    packed = Fp8Linear.pack(weight, bias) if fp8 and runs_in_fp8(weight) else PackedLinear.pack(weight, bias)
    if packed.packed or len(weights) > 1:  # the file's pages of these weights are dead weight now
        for w in weights:
            release_pages(w)
    return packed
