"""Triton GEMM over GGUF-quantized weights on CUDA (W4A16 / W8A16): y = x @ W.T with W read as the file stores it.

The weight stays in its GGUF fields, split into three device tensors at load (`TritonQuantWeight.of`): the quants
(Q4_0/Q4_1: the blocks' nibble bytes as they are, [N, K/2] uint8, byte i of a block holding weight i in its low
nibble and weight i + 16 in its high one; Q8_0: [N, K] int8), the scales d and the mins m ([K/32, N] float16,
transposed so that a tile's outputs read them side by side; Q4_0's min is -8d, Q8_0 has none). Each program
dequantizes a [BLOCK_K, BLOCK_N] tile in registers (w = q * d + m) and multiplies it with the activations' tile
on the tensor cores: a 4-bit tile's low nibbles against the activations of each block's first 16 inputs, its high
nibbles against the last 16, so each byte is loaded once. Decode steps are a few rows over many weights: the
reduction is split over `split` programs along K (enough programs to cover the device's SMs several times),
their float32 partial sums added in a fixed order after (deterministic, no atomics).

float32 activations multiply in IEEE float32 (no TF32), bfloat16 ones as bfloat16 with the dequantized weight
rounded to bfloat16, both accumulating in float32. On CPU the kernel runs in Triton's interpreter (tests).
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvloom.kernels.quantized_linear import QuantType, fields

GGUF_BLOCK = 32  # weights per GGUF block along the input
_INTERPRETED = triton.knobs.runtime.interpret  # decided at import, as @triton.jit decides
_DOT = {torch.float32: (tl.float32, "ieee"), torch.bfloat16: (tl.bfloat16, "tf32"),
        torch.float16: (tl.float16, "tf32")}  # tf32 is ignored for 16-bit operands


@dataclass(frozen=True)
class TritonQuantWeight:
    """A GGUF-quantized weight [N, K] as the Triton kernel reads it (see the module's docstring)."""

    quants: torch.Tensor  # uint8 [N, K/2] (4-bit) or int8 [N, K] (Q8_0)
    scales: torch.Tensor  # float16 [K/32, N]
    mins: torch.Tensor | None  # float16 [K/32, N] (Q4_0: -8 d), None for Q8_0
    qtype: QuantType

    @classmethod
    def of(cls, blocks: torch.Tensor, qtype: QuantType, device: torch.device) -> "TritonQuantWeight":
        d, m, q = fields(blocks, qtype)  # q [N, K/32, 32] in input order
        if qtype is QuantType.Q8_0:
            quants = q.reshape(q.shape[0], -1)
        else:  # the file's bytes again: weight i low, weight i + 16 high
            quants = (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)
        transposed = lambda t: None if t is None else t.t().contiguous().to(device)  # noqa: E731
        return cls(quants.contiguous().to(device), transposed(d), transposed(m), qtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[1], self.scales.shape[0] * GGUF_BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins) if t is not None)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, d_ptr, m_ptr, out_ptr,
    M, N, K, iters_per_split,
    stride_xm, stride_qn, stride_dk, stride_os, stride_om,
    FOUR_BIT: tl.constexpr, HAS_MIN: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[split, rows, cols] = the partial sum of x[rows, k] * W[cols, k] over this split's K range."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    HALF: tl.constexpr = BLOCK_K // 2
    for step in range(0, iters_per_split):
        k0 = (split * iters_per_split + step) * BLOCK_K
        if FOUR_BIT:
            # byte j of the tile: block (k0 + 2j) // 32, its weight j % 16 (low) and j % 16 + 16 (high)
            j = tl.arange(0, HALF)
            k_low = k0 + (j // 16) * 32 + j % 16
            k_ok = k_low < K
            byte = tl.load(q_ptr + cols[None, :] * stride_qn + (k_low // 32 * 16 + j % 16)[:, None],
                           mask=k_ok[:, None] & col_ok[None, :], other=0)
            d = tl.load(d_ptr + (k_low // 32)[:, None] * stride_dk + cols[None, :],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            w_low = (byte & 15).to(tl.float32) * d
            w_high = (byte >> 4).to(tl.float32) * d
            if HAS_MIN:
                m = tl.load(m_ptr + (k_low // 32)[:, None] * stride_dk + cols[None, :],
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                w_low += m
                w_high += m
            x_low = tl.load(x_ptr + rows[:, None] * stride_xm + k_low[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x_high = tl.load(x_ptr + rows[:, None] * stride_xm + (k_low + 16)[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x_low.to(DOT_DTYPE), w_low.to(DOT_DTYPE), input_precision=PRECISION)
            acc += tl.dot(x_high.to(DOT_DTYPE), w_high.to(DOT_DTYPE), input_precision=PRECISION)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            q = tl.load(q_ptr + cols[None, :] * stride_qn + k[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0)
            d = tl.load(d_ptr + (k // 32)[:, None] * stride_dk + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.dot(x.to(DOT_DTYPE), (q.to(tl.float32) * d).to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class LaunchShape:
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs along K
    iters_per_split: int
    num_warps: int = 4
    num_stages: int = 3


@lru_cache(maxsize=None)
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_shape(m: int, n: int, k: int, multiprocessors: int, block_n: int = 64, block_k: int = 128,
                 num_warps: int = 4, num_stages: int = 3) -> LaunchShape:
    """Tiles for `m` rows: 16 rows (the tensor cores' least) up to 64; the reduction split along K until the
    programs cover the SMs four times over, each keeping at least two K tiles."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    iters = triton.cdiv(k, block_k)
    split = max(1, min(iters // 2, triton.cdiv(4 * multiprocessors, tiles)))
    per_split = triton.cdiv(iters, split)
    return LaunchShape(block_m, block_n, block_k, triton.cdiv(iters, per_split), per_split, num_warps, num_stages)


def multiprocessors(device: torch.device) -> int:
    """The device's SMs (4 for the CPU interpreter: its splits are exercised too)."""
    return 4 if device.type == "cpu" else _multiprocessors(device.index)


def quant_matmul(x: torch.Tensor, weight: TritonQuantWeight, bias: torch.Tensor | None = None,
                 shape: LaunchShape | None = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16) @ weight.T (+ bias) -> [M, N] in x's dtype; `shape`: the launch's
    tiles, if not `launch_shape`'s (the benchmark's sweep)."""
    n, k = weight.shape
    m = x.shape[0]
    x = x.contiguous()
    if m == 0:
        return x.new_zeros(0, n)
    shape = shape or launch_shape(m, n, k, multiprocessors(x.device))
    partial = torch.empty(shape.split, m, n, dtype=torch.float32, device=x.device)
    # the CPU interpreter keeps bfloat16 as raw bits and would multiply those integers
    dot_dtype, precision = (tl.float32, "ieee") if _INTERPRETED else _DOT[x.dtype]
    four_bit = weight.qtype is not QuantType.Q8_0
    grid = (triton.cdiv(m, shape.block_m), triton.cdiv(n, shape.block_n), shape.split)
    _quant_matmul_kernel[grid](
        x, weight.quants, weight.scales, weight.mins if weight.mins is not None else weight.scales, partial,
        m, n, k, shape.iters_per_split,
        x.stride(0), weight.quants.stride(0), weight.scales.stride(0), partial.stride(0), partial.stride(1),
        FOUR_BIT=four_bit, HAS_MIN=weight.mins is not None, DOT_DTYPE=dot_dtype, PRECISION=precision,
        BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k, num_warps=shape.num_warps,
        num_stages=shape.num_stages,
    )
    out = partial[0] if shape.split == 1 else partial.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
