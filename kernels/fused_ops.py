"""Fused elementwise ops of kvloom's decoder: C++ on CPU (float32 or bfloat16, cpu_fused.cpp), torch elsewhere.

The torch versions are the definitions (tests hold the C++ ops to them) and serve CUDA and other
dtypes, where the surrounding GEMMs dominate anyway.
"""

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension


def fused_extension():
    return build_extension("kvloom_cpu_fused")


NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(*tensors: torch.Tensor):
    on_cpu = all(t.is_cpu and t.dtype in NATIVE_DTYPES for t in tensors)  # ~120 calls a step: is_cpu, not .device
    return fused_extension() if on_cpu else None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding gate | up -> silu(gate) * up, [T, I].

    C++ on CPU in one pass (cpu_fused.cpp), torch's definition elsewhere.
    """
    ext = _native(gate_up)
    if ext is not None and gate_up.is_contiguous():
        return ext.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_rotated_heads: int,
                      head_dim: int) -> None:
    """Rotate the first `num_rotated_heads` heads (query, then key) of fused QKV rows in place.

    HF's rotate-half convention: x * cos + rotate_half(x) * sin, with cos/sin [T, head_dim] float32
    (a bfloat16 qkv is rotated in float32 and rounded once).
    """
    ext = _native(qkv)
    if ext is not None:
        ext.rotary_embedding_(qkv, cos, sin, num_rotated_heads, head_dim)
        return
    heads = qkv[:, : num_rotated_heads * head_dim].unflatten(-1, (num_rotated_heads, head_dim))
    wide = heads.float()
    first, second = wide.chunk(2, dim=-1)
    heads.copy_(wide * cos[:, None] + torch.cat((-second, first), dim=-1) * sin[:, None])


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """residual += delta in place (skipped when None), then RMSNorm(residual) * weight; [T, hidden] rows.

    Under a bfloat16 model the residual stream and the norm weights stay float32 (the sum of many
    sublayer outputs is where rounding would accumulate); `delta` (a GEMM's output) may be bfloat16
    and the result, the next GEMM's input, is `out_dtype` (default: the residual's).
    """
    out_dtype = out_dtype or residual.dtype
    ext = _native(residual, weight, *([] if delta is None else [delta]))
    if ext is not None and residual.dtype == weight.dtype == torch.float32 and out_dtype in NATIVE_DTYPES:
        return ext.add_rms_norm_(residual, delta, weight, eps, out_dtype)
    if delta is not None:
        residual.add_(delta)
    return F.rms_norm(residual, (residual.shape[-1],), weight.to(residual.dtype), eps).to(out_dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, greedy sampling's pick: [R, V] -> [R] int64.

    C++ on CPU (float32 or bfloat16 rows): 48 rows of SmolLM2's 49,152 bfloat16 logits 0.1 ms against torch's
    max at 1.7-1.9 ms, ~3% of a batch-48 decode step (measured on the AVX512-BF16 EPYC). torch's `max` elsewhere.
    A NaN is skipped by the C++ op and picked by torch's: only a broken model produces one.
    """
    ext = _native(logits)
    if ext is not None and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        return ext.argmax_rows(logits)
    return logits.max(dim=-1).indices
