"""The CUDA quantized GEMM (Triton, GGUF Q4_0/Q4_1/Q8_0 blocks) against dequantize-then-matmul in float64.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors; as in test_triton_kernels.py, the flag must be
set before the process first imports triton, so where something imported it earlier the file re-runs itself in a
fresh process. The blocks are random bytes with finite scales (any such bytes are a valid block): the file needs no
GGUF quantizer.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kvloom.benchmarks.random_weights import random_gguf_blocks  # noqa: E402
from kvloom.kernels.gguf_blocks import QuantType, dequantize  # noqa: E402
from kvloom.kernels.quantized_linear import QuantizedLinear  # noqa: E402
from kvloom.kernels.triton_quant_gemm import (  # noqa: E402
    GEMV_MAX_ROWS, TritonQuantWeight, launch_shape, quant_matmul)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton_kernels  # conftest.py: CUDA, Triton's interpreter, or a fresh process


def test_whole_file_in_a_fresh_interpreter_process(rerun_in_fresh_interpreter):
    rerun_in_fresh_interpreter(__file__)


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("outputs,inputs,with_bias", [(72, 96, False), (136, 864, True)])
def test_the_gemm_matches_dequantize_then_matmul_in_float64(qtype, dtype, rows, outputs, inputs, with_bias):
    """Within 1e-5 of sum |x * w| (float32 sums), plus for bfloat16 2^-8 of it (each dequantized weight rounded to
    bfloat16) and 2^-8 of the result (its rounding). Up to GEMV_MAX_ROWS rows the GEMV, beyond it tl.dot; outputs
    not a multiple of either's tile (32, 64), inputs not of either's K tile (GEMV: 256 4-bit, 128 Q8_0; tl.dot: 128),
    and 864 inputs split across programs by both."""
    generator = torch.Generator().manual_seed(rows * outputs)
    blocks = random_gguf_blocks(outputs, inputs, qtype, generator)
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    x = torch.randn(rows, inputs, generator=generator).to(dtype)
    weight = TritonQuantWeight.of(blocks, qtype, DEVICE)
    out = quant_matmul(x.to(DEVICE), weight, None if bias is None else bias.to(DEVICE)).cpu()
    assert out.dtype == dtype and out.shape == (rows, outputs)
    reference = dequantize(blocks, qtype, torch.float64)
    expected = x.double() @ reference.T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ reference.abs().T + (0 if bias is None else bias.double().abs())
    rounding = 2 ** -8 * (bound + expected.abs()) if dtype == torch.bfloat16 else 0
    assert ((out.double() - expected).abs() <= 1e-5 * bound + rounding).all()


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_the_device_layout_holds_the_files_quants_and_scales(qtype):
    generator = torch.Generator().manual_seed(1)
    blocks = random_gguf_blocks(20, 64, qtype, generator)
    weight = TritonQuantWeight.of(blocks, qtype, torch.device("cpu"))
    assert weight.shape == (20, 64)
    raw = blocks.view(20, 2, qtype.block_bytes)
    assert torch.equal(weight.scales.view(torch.uint8).view(20, 2, 2), raw[..., :2])
    quant_bytes = raw[..., -(32 if qtype is QuantType.Q8_0 else 16):].reshape(20, -1)
    assert torch.equal(weight.quants.view(torch.uint8), quant_bytes)  # the file's bytes, not unpacked
    assert weight.nbytes == blocks.numel() + (20 * 2 * 2 if qtype is QuantType.Q4_0 else 0)  # Q4_0's min is made


@pytest.mark.parametrize("m, n, k, bits, gemv, split, iters", [
    (1, 6144, 4096, 4, True, 3, 6),  # GEMV: 192 output tiles of 32, 16 K tiles of 256: three splits, 576 programs
    (GEMV_MAX_ROWS, 6144, 4096, 4, True, 3, 6),  # the same split for any row count in the GEMV's range
    (1, 6144, 4096, 8, True, 3, 11),  # Q8_0: 32 K tiles of 128
    (1, 4096, 14336, 4, True, 5, 12),  # 128 tiles, 56 K tiles
    (GEMV_MAX_ROWS, 128256, 4096, 8, True, 1, 32),  # an LM head: 4008 tiles cover the SMs alone
    (GEMV_MAX_ROWS + 1, 6144, 4096, 4, False, 6, 6),  # tl.dot: 96 tiles of 16 x 64: six splits, over four per SM
    (16, 576, 576, 4, False, 2, 3),  # 9 tiles, 5 K tiles: no split keeps fewer than two
    (256, 4096, 14336, 8, False, 3, 38),  # 64-row tiles
    (40, 72, 96, 4, False, 1, 1)])
def test_the_reduction_is_split_to_cover_the_device_and_no_split_is_empty(m, n, k, bits, gemv, split, iters):
    shape = launch_shape(m, n, k, multiprocessors=132, bits=bits)
    assert (shape.gemv, shape.split, shape.iters_per_split) == (gemv, split, iters)
    k_tiles = -(-k // shape.block_k)
    assert (split - 1) * iters < k_tiles <= split * iters


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(qtype):
    """Decode batches change size every step: within the GEMV's range a row's float32 result is bitwise the same
    alone as in a batch of GEMV_MAX_ROWS (the K range split across programs)."""
    generator = torch.Generator().manual_seed(3)
    weight = TritonQuantWeight.of(random_gguf_blocks(136, 864, qtype, generator), qtype, DEVICE)
    x = torch.randn(GEMV_MAX_ROWS, 864, generator=generator).to(DEVICE)
    assert torch.equal(quant_matmul(x[:1], weight)[0], quant_matmul(x, weight)[0])


def test_an_empty_batch_gives_an_empty_result():
    weight = TritonQuantWeight.of(random_gguf_blocks(8, 32, QuantType.Q8_0, torch.Generator()), QuantType.Q8_0, DEVICE)
    assert quant_matmul(torch.empty(0, 32, device=DEVICE), weight).shape == (0, 8)


def test_a_quantized_linear_in_the_triton_layout_runs_the_triton_kernel():
    """The decoder's seam: `QuantizedLinear.pack` for a CUDA device takes this layout (tests/gpu runs an engine so)."""
    blocks = random_gguf_blocks(24, 64, QuantType.Q4_1, torch.Generator().manual_seed(2))
    linear = QuantizedLinear.for_triton(blocks, QuantType.Q4_1, None, DEVICE)
    assert isinstance(linear.weight, TritonQuantWeight) and linear.packed
    x = torch.randn(3, 64)
    expected = x.double() @ dequantize(blocks, QuantType.Q4_1, torch.float64).T
    assert torch.allclose(linear(x.to(DEVICE)).cpu().double(), expected, atol=1e-4)
