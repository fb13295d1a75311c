"""GGUF-quantized linears (Q4_1, Q4_0, Q8_0) run as stored, by kvloom's kernel (kernels/cpu_quant_gemm.cpp).

Blocks come from the gguf package's own quantizer and from the embedded SmolLM2 file; the reference is the weight
dequantized in plain torch, checked against the gguf package's dequantizer, and multiplied in float64. Each kernel
build this host runs is tested: the native one, and the builds for the instruction sets below it (AVX-512, AVX2,
baseline x86-64: cpu_extensions.ISA_VARIANTS), each through its own code path; which builds a CPU runs is decided
from faked CPU flags on any host.
"""

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvloom.kernels import cpu_extensions, quantized_linear
from kvloom.kernels.host_isa import HostISA, host_isa
from kvloom.kernels.packed_linear import Layout, PackedLinear, gemm_extension, to_blocked
from kvloom.kernels.gguf_blocks import QuantType, dequantize
from kvloom.kernels.quantized_linear import QuantizedLinear, pack

# the kernel builds: this CPU's own (None), then the ISA variants, each where the host runs it
BUILDS = [pytest.param(None, id="native"),
          pytest.param("avx512", marks=pytest.mark.host("avx512-build")),
          pytest.param("avx2", marks=pytest.mark.host("avx2-build")),
          pytest.param("generic", marks=pytest.mark.host("x86-64-build"))]
ZEN4 = "sse2 avx avx2 fma f16c bmi1 bmi2 movbe avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16"
HASWELL = "sse2 avx avx2 fma f16c bmi1 bmi2 movbe"


def gguf_blocks(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """[N, K] float32 -> the file's bytes for it, [N, K/32 * block bytes] uint8 (the gguf package's quantizer)."""
    return torch.from_numpy(gguf_quantize(weight.numpy(), qtype.value))


@pytest.fixture(scope="module")
def smollm2_tensors():
    """Tensors of the embedded SmolLM2 GGUF file by name (Q4_1 layers, a Q8_0 embedding table)."""
    from kvloom.engine.model.gguf_convert import read_gguf
    from kvloom.engine.model.model_files import embedded_gguf

    return {t.name: t for t in read_gguf(embedded_gguf("smollm2"))[1]}


def file_blocks(tensors, name: str, rows: int) -> tuple[torch.Tensor, QuantType]:
    tensor = tensors[name]
    return torch.from_numpy(np.array(tensor.data[:rows])), QuantType(tensor.tensor_type.value)


def kernel(variant: str | None):
    ops = quantized_linear.quant_kernel(variant)
    assert ops is not None, f"the quantized GEMM failed to build ({variant or 'native'})"
    return ops


def path(variant: str | None, qtype: QuantType, dtype: torch.dtype, rows: int, int8: bool = False) -> str:
    """The code a build runs for a call of `rows` rows (`int8`: int8 activations asked for)."""
    ops = kernel(variant)
    return getattr(ops, f"quant_linear_path_{variant}" if variant else "quant_linear_path")(qtype.bits, dtype, rows,
                                                                                             int8)


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_dequantize_equals_the_gguf_packages(qtype, smollm2_tensors):
    """The reference itself: on blocks from the gguf package's quantizer, and on the file's where it has the type."""
    torch.manual_seed(0)
    cases = [gguf_blocks(torch.randn(24, 96), qtype)]
    name = {QuantType.Q4_1: "blk.0.ffn_down.weight", QuantType.Q8_0: "token_embd.weight"}.get(qtype)
    if name:
        cases.append(file_blocks(smollm2_tensors, name, 64)[0])
    for blocks in cases:
        expected = torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype.value).astype(np.float32))
        assert torch.equal(dequantize(blocks, qtype), expected)


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("name", ["blk.3.attn_v.weight", "token_embd.weight"])
def test_packed_tiles_give_back_every_weight_of_the_files_blocks(variant, name, smollm2_tensors):
    """Round trip: the GEMM of x = identity reads every packed weight back out, bit for bit (one product a sum),
    as the file's blocks dequantize, for the file's Q4_1 and Q8_0 tensors (rows not a multiple of 16)."""
    blocks, qtype = file_blocks(smollm2_tensors, name, 40)
    kernel(variant)
    linear = QuantizedLinear.pack(blocks, qtype, torch.float32, variant=variant)
    assert linear.layout is Layout.QUANTIZED
    weight = dequantize(blocks, qtype)
    assert torch.equal(linear(torch.eye(weight.shape[1])).T, weight)


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("outputs,inputs,with_bias", [(40, 96, False), (200, 1536, True)])
def test_the_gemm_matches_dequantize_then_matmul_in_float64(variant, qtype, dtype, rows, outputs, inputs, with_bias):
    """Within 1e-5 of sum |x * w| (float32 sums over K) plus, for bfloat16 activations, 2^-8 of the result (its one
    rounding to bfloat16), and 2^-9 of sum |x * w| where the weights are de-quantized to bfloat16 (from 32 rows, with
    AVX512-BF16); outputs not a multiple of the 16-output tile, every row-block size of each build."""
    torch.manual_seed(rows)
    blocks = gguf_blocks(torch.randn(outputs, inputs) * 0.1, qtype)
    bias = torch.randn(outputs) if with_bias else None
    kernel(variant)
    linear = QuantizedLinear.pack(blocks, qtype, dtype, bias, variant=variant)
    x = torch.randn(rows, inputs).to(dtype)
    out = linear(x)
    assert out.dtype == dtype and out.shape == (rows, outputs)
    weight = dequantize(blocks, qtype, torch.float64)
    expected = x.double() @ weight.T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ weight.abs().T + (0 if bias is None else bias.double().abs())
    rounding = 2 ** -8 * expected.abs() if dtype == torch.bfloat16 else 0
    weights_rounded = path(variant, qtype, dtype, rows).endswith("-dequantized")
    assert ((out.double() - expected).abs() <= (1e-5 + weights_rounded * 2 ** -9) * bound + rounding).all()


@pytest.mark.host("avx512-bf16")
@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [31, 32, 33, 100])
@pytest.mark.parametrize("outputs,inputs,with_bias", [(40, 96, False), (200, 1536, True), (576, 576, False)])
def test_many_bfloat16_rows_compute_what_the_dequantized_models_gemm_does_bit_for_bit(qtype, rows, outputs, inputs,
                                                                                      with_bias):
    """From 32 rows, bfloat16 x meets the tiles de-quantized to bfloat16 (d*q + m in float32, rounded once) and runs
    kvloom's blocked GEMM kernel on them: the same bits as the de-quantized model's own linear (its weight rounded
    to bfloat16, laid out blocked), for an odd tile count, a bias, and row groups split for too few weight blocks.
    Fewer rows run the exact kernel, which differs."""
    torch.manual_seed(rows)
    blocks = gguf_blocks(torch.randn(outputs, inputs) * 0.1, qtype)
    bias = torch.randn(outputs) if with_bias else None
    linear = QuantizedLinear.pack(blocks, qtype, torch.bfloat16, bias)
    # the de-quantized model's linear where the blocked layout is this host's (AVX-512 without AMX tiles)
    assert gemm_extension() is not None
    dense = PackedLinear(to_blocked(dequantize(blocks, qtype).bfloat16()), bias, Layout.BLOCKED, outputs)
    x = torch.randn(rows, inputs).bfloat16()
    assert torch.equal(linear(x), dense(x)) == (rows >= 32)


@pytest.mark.host("avx512-vnni")
@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("outputs,inputs,with_bias", [(40, 96, False), (200, 1536, True)])
def test_int8_activations_stay_within_their_own_rounding(qtype, dtype, rows, outputs, inputs, with_bias):
    """`quantization: gguf-int8`: a bfloat16 linear's tiles take the int8 kernel's own layout, and x (of either
    dtype) is quantized to int8 a block of 32 at a time (a step of max|x|/127) and multiplied with the file's
    integers by VPDPBUSD, at every row count. Against dequantize-then-matmul in float64, the error stays within each
    block's rounding (half a step times the block's sum |w|), the float32 sums' and, for bfloat16 x, the result's
    rounding to bfloat16. A float32 linear stays exact."""
    torch.manual_seed(rows)
    blocks = gguf_blocks(torch.randn(outputs, inputs) * 0.1, qtype)
    bias = torch.randn(outputs) if with_bias else None
    linear = QuantizedLinear.pack(blocks, qtype, torch.bfloat16, bias, int8=True)
    assert linear.int8 and path(None, qtype, dtype, rows, int8=True) == "avx512vnni-int8"
    assert not QuantizedLinear.pack(blocks, qtype, torch.float32, bias, int8=True).int8
    x = torch.randn(rows, inputs).to(dtype)
    out = linear(x)
    assert out.dtype == dtype and out.shape == (rows, outputs)
    weight = dequantize(blocks, qtype, torch.float64)
    expected = x.double() @ weight.T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ weight.abs().T + (0 if bias is None else bias.double().abs())
    step = x.double().unflatten(1, (-1, 32)).abs().amax(-1) / 127  # [rows, blocks]
    rounding = 0.5 * step @ weight.abs().unflatten(1, (-1, 32)).sum(-1).T
    result_rounding = 2 ** -8 * expected.abs() if dtype == torch.bfloat16 else 0
    error = (out.double() - expected).abs()
    assert (error <= 1e-5 * bound + rounding + result_rounding).all()
    assert not torch.equal(out, QuantizedLinear.pack(blocks, qtype, dtype, bias)(x))  # int8 ran, not the exact path


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("qtype", [QuantType.Q4_1, QuantType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(variant, qtype, dtype):
    """The same bits for a row alone, in 3 rows or in 17 or in 64 (each register block's size and the tiles it runs
    side by side change with the rows; each output's sum keeps its order): greedy text independent of the batch.
    Calls of 32 rows or more of bfloat16 x on AVX512-BF16 (de-quantized tiles) compute otherwise, and agree among
    themselves; int8 activations (VNNI) give a row the same bits at every row count."""
    torch.manual_seed(0)
    blocks = gguf_blocks(torch.randn(200, 96), qtype)
    kernel(variant)
    x = torch.randn(64, 96).to(dtype)
    for int8 in (False, True):
        linear = QuantizedLinear.pack(blocks, qtype, torch.bfloat16, variant=variant, int8=int8)
        batched = linear(x)
        for rows in (slice(5, 6), slice(9, 12), slice(0, 17), slice(20, 60)):
            alone = linear(x[rows])
            alone_path = path(variant, qtype, dtype, rows.stop - rows.start, int8)
            assert torch.equal(alone, batched[rows]) or alone_path != path(variant, qtype, dtype, 64, int8)


@pytest.mark.parametrize("variant", BUILDS)
def test_each_build_runs_the_path_of_its_instruction_set(variant):
    """A variant runs its own instruction set's code; the native build, the best this CPU has: VDPBF16PS on bfloat16
    pairs for bfloat16 activations where AVX512-BF16 is present (from 32 rows on tiles de-quantized to bfloat16),
    and, int8 activations asked for, VPDPBUSD at every row count where VNNI is (elsewhere the tiles keep the exact
    kernel's layout and it runs)."""
    isa = host_isa()
    best = variant or ("avx512" if isa.avx512 else "avx2" if "avx2" in isa.flags else "generic")
    pairs = variant is None and isa.avx512_bf16
    int8 = variant is None and "avx512_vnni" in isa.flags
    for qtype in (QuantType.Q4_1, QuantType.Q8_0):
        assert path(variant, qtype, torch.float32, 1) == path(variant, qtype, torch.float32, 64) == best
        assert path(variant, qtype, torch.bfloat16, 31) == ("avx512bf16" if pairs else best)
        assert path(variant, qtype, torch.bfloat16, 32) == ("avx512bf16-dequantized" if pairs else best)
        assert path(variant, qtype, torch.bfloat16, 1, int8=True) == ("avx512vnni-int8" if int8 else
                                                                     "avx512bf16" if pairs else best)
        assert path(variant, qtype, torch.float32, 64, int8=True) == ("avx512vnni-int8" if int8 else best)
        blocks = gguf_blocks(torch.randn(40, 64), qtype)
        linear = QuantizedLinear.pack(blocks, qtype, torch.bfloat16, variant=variant, int8=True)
        assert linear.int8 == int8 and linear.int8 == quantized_linear.int8_dots(variant)
        assert torch.equal(linear.weight, pack(blocks, qtype, int8))


@pytest.mark.parametrize("flags,machine,expected", [
    (ZEN4, "x86_64", ["avx512", "avx2", "generic"]), (HASWELL, "x86_64", ["avx2", "generic"]),
    ("sse2", "x86_64", ["generic"]), ("asimd sve", "aarch64", [])])
def test_the_builds_a_cpu_runs_are_decided_from_its_flags(monkeypatch, flags, machine, expected):
    monkeypatch.setattr(cpu_extensions.platform, "machine", lambda: machine)
    assert cpu_extensions.isa_variants(HostISA("fake", frozenset(flags.split()))) == expected


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_tiles_hold_the_files_bytes_and_no_kernel_means_dense(monkeypatch, qtype):
    """Packed, a weight takes its file's bytes (Q4_0 gains a float16 min a block), in the int8 kernel's layout too;
    without the kernel (no compiler) it is dequantized once and runs dense, in the activations' dtype."""
    torch.manual_seed(0)
    blocks, x = gguf_blocks(torch.randn(48, 64), qtype), torch.randn(5, 64)
    kernel(None)
    packed = QuantizedLinear.pack(blocks, qtype, torch.float32)
    assert packed.packed and packed.weight.dtype == torch.uint8
    assert packed.weight.numel() == blocks.numel() + (48 * 2 * 2 if qtype is QuantType.Q4_0 else 0)
    assert torch.equal(packed.weight, pack(blocks, qtype))
    assert pack(blocks, qtype, int8=True).shape == packed.weight.shape
    monkeypatch.setattr(quantized_linear, "quant_kernel", lambda variant=None: None)
    dense = QuantizedLinear.pack(blocks, qtype, torch.bfloat16)
    assert dense.layout is Layout.DENSE and not dense.packed and dense.weight.dtype == torch.bfloat16
    torch.testing.assert_close(dense(x.bfloat16()), torch.nn.functional.linear(x.bfloat16(), dense.weight))
    torch.testing.assert_close(packed(x), x @ dequantize(blocks, qtype).T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_gemm_gives_the_same_bits_on_any_thread_count(same_on_any_thread_count, dtype):
    """Work items go to whichever thread asks first, but each output is one thread's sum in one order, on torch's
    OpenMP team or kvloom's item pool."""
    torch.manual_seed(0)
    blocks = gguf_blocks(torch.randn(3072, 576), QuantType.Q4_1)
    kernel(None)
    linear = QuantizedLinear.pack(blocks, QuantType.Q4_1, dtype)
    x = torch.randn(100, 576).to(dtype)
    assert same_on_any_thread_count(lambda: linear(x))
