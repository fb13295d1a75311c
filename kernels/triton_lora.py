"""Triton segmented matmul for LoRA deltas on CUDA: punica's SGMV over a step's adapter segments, one launch.

`out[rows of segment s] (+)= x[rows of segment s] @ w[slot of s]` for every segment at once: grid (segment, row
tile, column tile), each program reading its segment's bounds and weight slot from small device tables. The LoRA
shrink (x @ A, into a [T, R] buffer) and expand (+= t @ B, into the linear's output) are two calls of it. Rows in
no segment (base rows) are never read or written. A row window (`row_offset`, `num_rows`) lets a caller pass a
slice of the step's rows (the decoder's MLP runs in row chunks). fp32 operands multiply in IEEE fp32 (no TF32):
a float32 model's LoRA delta matches the CPU's.
"""

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32
_DOT_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}  # tf32: ignored for 16-bit
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_INTERPRETED = triton.knobs.runtime.interpret  # decided at import, as @triton.jit decides


@triton.jit
def _segmented_matmul_kernel(
    x_ptr, w_ptr, out_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr,
    row_offset, num_rows, K, N,
    stride_xm, stride_xk, stride_ws, stride_wk, stride_wn, stride_om, stride_on,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.maximum(tl.load(seg_start_ptr + segment) - row_offset, 0)
    end = tl.minimum(tl.load(seg_end_ptr + segment) - row_offset, num_rows)
    first = start + tl.program_id(1) * BLOCK_M
    if first < end:
        slot = tl.load(seg_slot_ptr + segment).to(tl.int64)
        rows = first + tl.arange(0, BLOCK_M)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + slot * stride_ws + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def segmented_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                     slots: torch.Tensor, longest: int, row_offset: int = 0, accumulate: bool = False) -> None:
    """out[r] (+)= x[r] @ w[slots[s]] for the rows r of each segment s (step rows starts[s]..ends[s], minus
    `row_offset`, within x's rows). x [T, K], w [S, K, N], out [T, N]; `longest`: the longest segment's rows."""
    if not len(starts) or not x.shape[0]:
        return
    K, N = w.shape[1], w.shape[2]
    # the CPU interpreter keeps bfloat16 as raw bits and would multiply those integers
    dot_dtype = tl.float32 if _INTERPRETED and x.dtype == torch.bfloat16 else _DOT_DTYPES[x.dtype]
    starts, ends, slots = starts.contiguous(), ends.contiguous(), slots.contiguous()
    grid = (len(starts), triton.cdiv(longest, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _segmented_matmul_kernel[grid](
        x, w, out, starts, ends, slots, row_offset, x.shape[0], K, N,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, PRECISION=_DOT_PRECISION[x.dtype], DOT_DTYPE=dot_dtype,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
