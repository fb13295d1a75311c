"""Triton GEMM over GGUF-quantized weights on CUDA (W4A16 / W8A16): y = x @ W.T with W read as the file stores it.

The weight stays in its GGUF fields, split into three device tensors at load (`TritonQuantWeight.of`): the quants
(Q4_0/Q4_1: the blocks' nibble bytes as they are, [N, K/2] uint8, byte i of a block holding weight i in its low
nibble and weight i + 16 in its high one; Q8_0: [N, K] int8), the scales d and the mins m ([N, K/32] float16, one
per block as in the file; Q4_0's min is -8d, Q8_0 has none); a weight is w = q * d + m. Two kernels read them:

- up to GEMV_MAX_ROWS rows (decode), `_quant_gemv_kernel` on the CUDA cores, as llama.cpp's mmvq: each program
  owns BLOCK_N outputs and walks K, loading their [BLOCK_N, BLOCK_K] tile as it lies (K contiguous: 16-byte loads)
  and its scales once per GGUF block, broadcast over the block's quants; it dequantizes the tile in float32 and
  multiplies it with each row's inputs in turn, summing over K, so the weight is read once for all rows.
- more rows, `_quant_matmul_kernel` on the tensor cores: it dequantizes a [BLOCK_K, BLOCK_N] tile in registers, a
  4-bit tile's low nibbles multiplying the activations of each block's first 16 inputs, its high nibbles the last
  16, so each byte is loaded once.

Both split the reduction over `split` programs along K (enough programs to cover the device's SMs several times)
and add their float32 partial sums in a fixed order after (deterministic, no atomics). The GEMV's split does not
depend on the row count, so neither does a row's result (decode batches change size every step).

float32 activations multiply in IEEE float32 (no TF32). bfloat16 ones multiply in float32 in the GEMV, and as
bfloat16 with the dequantized weight rounded to bfloat16 on the tensor cores. All accumulate in float32. On CPU the
kernels run in Triton's interpreter (tests).
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvloom.kernels.gguf_blocks import QuantType, fields

GGUF_BLOCK = 32  # weights per GGUF block along the input
GEMV_MAX_ROWS = 8  # as llama.cpp's mmvq: a weight costs ~3 ops to dequantize + 1 FMA per row; past 8, ALU-bound
# a GEMV step: 32 outputs x 128 quant bytes, 16 per thread of 8 warps; each load of a row's inputs (128) is then
# smaller than the 256 threads, so Triton loads it straight into the product's layout, not via shared memory
_GEMV_BLOCK_N, _GEMV_ROW_BYTES, _GEMV_WARPS = 32, 128, 8
_DOT_TILE = (64, 128, 4)  # block_n, block_k, warps
_INTERPRETED = triton.knobs.runtime.interpret  # decided at import, as @triton.jit decides
_DOT = {torch.float32: (tl.float32, "ieee"), torch.bfloat16: (tl.bfloat16, "tf32"),
        torch.float16: (tl.float16, "tf32")}  # tf32 is ignored for 16-bit operands


@dataclass(frozen=True)
class TritonQuantWeight:
    """A GGUF-quantized weight [N, K] as the Triton kernels read it (see the module's docstring)."""

    quants: torch.Tensor  # uint8 [N, K/2] (4-bit) or int8 [N, K] (Q8_0)
    scales: torch.Tensor  # float16 [N, K/32]
    mins: torch.Tensor | None  # float16 [N, K/32] (Q4_0: -8 d), None for Q8_0
    qtype: QuantType

    @classmethod
    def of(cls, blocks: torch.Tensor, qtype: QuantType, device: torch.device) -> "TritonQuantWeight":
        d, m, q = fields(blocks, qtype)  # q [N, K/32, 32] in input order
        if qtype is QuantType.Q8_0:
            quants = q.reshape(q.shape[0], -1)
        else:  # the file's bytes again: weight i low, weight i + 16 high
            quants = (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)
        on_device = lambda t: None if t is None else t.contiguous().to(device)  # noqa: E731
        return cls(on_device(quants), on_device(d), on_device(m), qtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * GGUF_BLOCK

    @property
    def nbytes(self) -> int:
        """The bytes a call reads: quants, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins) if t is not None)


@triton.jit(do_not_specialize=["M", "N", "K", "iters_per_split"])  # one build for every shape
def _quant_gemv_kernel(
    x_ptr, q_ptr, d_ptr, m_ptr, out_ptr,
    M, N, K, iters_per_split,
    stride_xm, stride_qn, stride_dn, stride_os, stride_om,
    FOUR_BIT: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[split, rows, cols] as `_quant_matmul_kernel`'s, on the CUDA cores: each step dequantizes the weight's
    [BLOCK_N, BLOCK_K / 32 blocks, quant bytes per block] tile once and sums its products with each row's inputs."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    BLOCKS: tl.constexpr = BLOCK_K // 32
    SPAN: tl.constexpr = 16 if FOUR_BIT else 32  # quant bytes per GGUF block
    i = tl.arange(0, SPAN)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # [cols, rows]
    for step in range(0, iters_per_split):
        block = (split * iters_per_split + step) * BLOCKS + tl.arange(0, BLOCKS)  # GGUF blocks along K
        block_ok = block < K // 32
        tile_ok = col_ok[:, None] & block_ok[None, :]
        q = tl.load(q_ptr + cols[:, None, None] * stride_qn + (block * SPAN)[None, :, None] + i[None, None, :],
                    mask=tile_ok[:, :, None], other=0)
        d = tl.load(d_ptr + cols[:, None] * stride_dn + block[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        if FOUR_BIT:  # w_first: each block's weights 0..15 (low nibbles), w_second: 16..31 (high)
            w_first = (q & 15).to(tl.float32) * d[:, :, None]
            w_second = (q >> 4).to(tl.float32) * d[:, :, None]
            if HAS_MIN:
                m = tl.load(m_ptr + cols[:, None] * stride_dn + block[None, :], mask=tile_ok, other=0.0)
                w_first += m.to(tl.float32)[:, :, None]
                w_second += m.to(tl.float32)[:, :, None]
        else:
            w_first = q.to(tl.float32) * d[:, :, None]
        k_first = (block * 32)[:, None] + i[None, :]  # the inputs of w_first, [BLOCKS, SPAN]
        for r in tl.static_range(BLOCK_M):
            row = tl.program_id(0) * BLOCK_M + r
            if row < M:
                x = tl.load(x_ptr + row * stride_xm + k_first, mask=block_ok[:, None], other=0.0).to(tl.float32)
                products = w_first * x[None, :, :]
                if FOUR_BIT:
                    x = tl.load(x_ptr + row * stride_xm + k_first + 16, mask=block_ok[:, None], other=0.0)
                    products += w_second * x.to(tl.float32)[None, :, :]
                total = tl.sum(tl.sum(products, axis=2), axis=1)
                acc = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc + total[:, None], acc)
    tl.store(out_ptr + split * stride_os + rows[None, :] * stride_om + cols[:, None], acc,
             mask=(rows < M)[None, :] & col_ok[:, None])


@triton.jit(do_not_specialize=["M", "N", "K", "iters_per_split"])  # one build for every shape
def _quant_matmul_kernel(
    x_ptr, q_ptr, d_ptr, m_ptr, out_ptr,
    M, N, K, iters_per_split,
    stride_xm, stride_qn, stride_dn, stride_os, stride_om,
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
            d = tl.load(d_ptr + cols[None, :] * stride_dn + (k_low // 32)[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            w_low = (byte & 15).to(tl.float32) * d
            w_high = (byte >> 4).to(tl.float32) * d
            if HAS_MIN:
                m = tl.load(m_ptr + cols[None, :] * stride_dn + (k_low // 32)[:, None],
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
            d = tl.load(d_ptr + cols[None, :] * stride_dn + (k // 32)[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.dot(x.to(DOT_DTYPE), (q.to(tl.float32) * d).to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class LaunchShape:
    gemv: bool  # `_quant_gemv_kernel`, else `_quant_matmul_kernel`
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


@lru_cache(maxsize=4096)  # pure, and asked on every call of every linear
def launch_shape(m: int, n: int, k: int, multiprocessors: int, block_n: int | None = None, block_k: int | None = None,
                 num_warps: int | None = None, num_stages: int = 3, bits: int = 4) -> LaunchShape:
    """Tiles for `m` rows of a `bits`-bit weight [n, k]: up to GEMV_MAX_ROWS the GEMV's, all rows in one program
    (their power of two); beyond, tl.dot's 16 rows (the tensor cores' least) up to 64. The reduction is split along K
    until the programs cover the SMs four times over, each keeping at least two K tiles; a GEMV's split does not
    depend on `m`."""
    gemv = m <= GEMV_MAX_ROWS
    if gemv:
        block_m, defaults = triton.next_power_of_2(m), (_GEMV_BLOCK_N, _GEMV_ROW_BYTES * 8 // bits, _GEMV_WARPS)
    else:
        block_m, defaults = 16 if m <= 16 else 32 if m <= 32 else 64, _DOT_TILE
    block_n, block_k, num_warps = (given or default for given, default in zip((block_n, block_k, num_warps), defaults))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    iters = triton.cdiv(k, block_k)
    split = max(1, min(iters // 2, triton.cdiv(4 * multiprocessors, tiles)))
    per_split = triton.cdiv(iters, split)
    return LaunchShape(gemv, block_m, block_n, block_k, triton.cdiv(iters, per_split), per_split, num_warps,
                       num_stages)


def multiprocessors(device: torch.device) -> int:
    """The device's SMs (4 for the CPU interpreter: its splits are exercised too)."""
    return 4 if device.type == "cpu" else _multiprocessors(device.index)


def quant_matmul(x: torch.Tensor, weight: TritonQuantWeight, bias: torch.Tensor | None = None,
                 shape: LaunchShape | None = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16) @ weight.T (+ bias) -> [M, N] in x's dtype; `shape`: the launch's
    kernel and tiles, if not `launch_shape`'s (the benchmark's sweep)."""
    n, k = weight.shape
    m = x.shape[0]
    x = x.contiguous()
    if m == 0:
        return x.new_zeros(0, n)
    shape = shape or launch_shape(m, n, k, multiprocessors(x.device), bits=weight.qtype.bits)
    partial = torch.empty(shape.split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, shape.block_m), triton.cdiv(n, shape.block_n), shape.split)
    args = (x, weight.quants, weight.scales, weight.mins if weight.mins is not None else weight.scales, partial,
            m, n, k, shape.iters_per_split,
            x.stride(0), weight.quants.stride(0), weight.scales.stride(0), partial.stride(0), partial.stride(1))
    meta = dict(FOUR_BIT=weight.qtype is not QuantType.Q8_0, HAS_MIN=weight.mins is not None,
                BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k, num_warps=shape.num_warps,
                num_stages=shape.num_stages)
    if shape.gemv:
        _quant_gemv_kernel[grid](*args, **meta)
    else:
        # the CPU interpreter keeps bfloat16 as raw bits and would multiply those integers
        dot_dtype, precision = (tl.float32, "ieee") if _INTERPRETED else _DOT[x.dtype]
        _quant_matmul_kernel[grid](*args, DOT_DTYPE=dot_dtype, PRECISION=precision, **meta)
    out = partial[0] if shape.split == 1 else partial.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
