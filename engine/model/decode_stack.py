"""A decode-only CPU step's decoder layers in one C++ call (kernels/cpu_decode_stack.cpp).

At batch 1 a layer's ~12 ops cost about as much in Python (wrappers, torch.ops dispatch, views) as in their own
work (measured in docs/performance.md, session 47). The C++ op calls the same ops in the same order, so its output is the loop's
bit for bit; it runs a step whose every row is one request's one new token, on the CPU attention backend and one
device, LoRA deltas added by their C++ op where the step's adapters are laid out for it. Every other step (prompt
chunks, speculation's verification, tensor parallelism) keeps the Python loop.
"""

from dataclasses import dataclass

import torch

from kvloom.engine.lora.lora_step import LINEAR_INDEX
from kvloom.engine.model.attention import ForwardContext
from kvloom.kernels.cpu_attention import CACHE_DTYPES, QUERY_DTYPES, decode_extension
from kvloom.kernels.cpu_extensions import build_extension
from kvloom.kernels.fused_ops import fused_extension
from kvloom.kernels.packed_linear import Layout, PackedLinear
from kvloom.kernels.quantized_linear import QuantizedLinear

LINEARS = ("qkv", "o_proj", "gate_up", "down")  # a layer's, in the op's order: LoRA's table rows are 4 * layer + this
assert tuple(LINEAR_INDEX) == LINEARS, "the op adds LoRA table row 4 * layer + linear: the orders must agree"
LINEAR_KINDS = {Layout.BLOCKED: 2, Layout.ONEDNN: 3, Layout.SHARED: 3, Layout.DENSE: 4}  # cpu_decode_stack.cpp's
QUANTIZED, QUANTIZED_INT8 = 0, 1


def _kind(linear: PackedLinear | QuantizedLinear) -> int | None:
    """How the C++ op runs a CPU model's `linear`, or None where it cannot (an ISA variant's build, FP8)."""
    if isinstance(linear, QuantizedLinear) and linear.layout is Layout.QUANTIZED:
        return None if linear.variant else QUANTIZED_INT8 if linear.int8 else QUANTIZED
    return LINEAR_KINDS.get(linear.layout)


@dataclass(frozen=True)
class DecodeStack:
    """The layers' weights as the C++ op takes them, gathered once at load."""

    input_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    kinds: list[int]  # four linears a layer: qkv, o_proj, gate|up, down
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    out_features: list[int]
    bits: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, layers: list, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> "DecodeStack | None":
        """For FusedLayers of one CPU model's whole stack, or None where the op cannot run them (see `_kind`), the
        kernels are not built, or the attention kernel has no code for these heads."""
        linears = [getattr(layer, name) for layer in layers for name in LINEARS]
        kinds = [_kind(linear) for linear in linears]
        decode = decode_extension()
        if (None in kinds or dtype not in QUERY_DTYPES or dtype not in CACHE_DTYPES or decode is None
                or not decode.paged_decode_supported(head_dim, heads // kv_heads)
                or fused_extension() is None or build_extension("kvloom_cpu_stack") is None):
            return None
        return cls(
            input_norms=[layer.input_norm for layer in layers],
            post_norms=[layer.post_attention_norm for layer in layers],
            kinds=kinds, weights=[linear.weight for linear in linears], biases=[linear.bias for linear in linears],
            out_features=[linear.out_features for linear in linears],
            bits=[linear.qtype.bits if isinstance(linear, QuantizedLinear) else 0 for linear in linears],
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)

    def runs(self, context: ForwardContext, num_tokens: int, max_rows: int) -> bool:
        """Whether this step is one the op runs: one new token a request, the CPU backend, a cache of the model's dtype
        (written as it is), at most `max_rows` rows (the MLP's pass), adapters (if any) laid out for the C++ op."""
        meta, lora = context.meta, context.lora
        return (meta.max_query_len == 1 and num_tokens <= max_rows and (not lora or lora.op_tables is not None)
                and context.backend.name == "cpu" and context.kv_caches[0][0].dtype == self.dtype)

    def __call__(self, residual: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 context: ForwardContext, num_layers: int, final_norm: torch.Tensor, scale: float, eps: float
                 ) -> torch.Tensor:
        """The first `num_layers` layers on layer 0's normalized input `hidden` (residual updated in place); the
        last layer's output normalized by `final_norm`."""
        meta, caches = context.meta, context.kv_caches[:num_layers]
        lora_tables, lora_rows = context.lora.op_tables if context.lora else (None, None)
        return torch.ops.kvloom.decode_stack(
            residual, hidden, cos, sin, self.input_norms, self.post_norms, final_norm,
            [key for key, _ in caches], [value for _, value in caches], meta.slot_mapping, meta.block_tables,
            meta.seq_lens, lora_tables, lora_rows, self.kinds, self.weights, self.biases, self.out_features,
            self.bits, self.heads, self.kv_heads, self.head_dim, scale, eps, self.dtype)
