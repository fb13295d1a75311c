"""Linear layers whose weights are laid out once for the CPU kernel that runs them best (float32 or bfloat16).

torch's eager `F.linear` on CPU is MKL's sgemm, which re-packs the weight on every call and is weak at the row
counts decode runs at; oneDNN with the weight packed ahead of time is much faster there, and with AMX tiles it
runs bfloat16 on them directly. On other AVX-512 CPUs kvloom's own kernel (cpu_gemm.cpp) runs the weight laid
out in blocks of 32 outputs by 32-bit words of inputs (a pair of bfloat16 or one float32): with AVX512-BF16 dot
products oneDNN's bfloat16 GEMM is weak below a few hundred rows, and without bfloat16 units oneDNN would emulate
bfloat16 where this kernel widens the weights in registers (half of float32's bytes at float32's math). Packed
tensors are opaque (only their kernel reads them); elsewhere (GPUs, float16, builds without oneDNN) the weight
stays dense and `F.linear` runs as before. The choice is made from the CPU's flags and the host's builds alone
(`choose_layout`), apart from the one step that lays the weight out (`lay_out`). The measurements behind each
choice: docs/performance.md, "Design choices".
"""

import enum
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension
from kvloom.kernels.host_isa import HostISA, host_isa

PACK_ROWS_HINT = 64  # the row count oneDNN picks its weight layout for; any row count works after
# oneDNN builds a GEMM primitive per row count, and both its cache and ideep's hold up to 1024 of them,
# ~0.6 MB each: a run visiting every decode batch size 1..64 kept ~150 MB. A step needs five (one per
# weight shape), so 32 keeps the last few batch sizes; a rebuild costs ~1-2 ms. Read at first use.
PRIMITIVE_CACHE_CAPACITY = "32"
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, PRIMITIVE_CACHE_CAPACITY)


OUTPUT_BLOCK = 32  # outputs per block of the blocked layout (cpu_gemm.cpp's BLOCK_N)


class Layout(enum.Enum):
    DENSE = "dense"    # [out, in] as loaded, run by F.linear
    SHARED = "shared"  # [out, in], read as it is by oneDNN (shared with another reader)
    ONEDNN = "onednn"  # oneDNN's blocked layout
    BLOCKED = "blocked"  # [ceil(out/32), in/E, 32, E], E inputs a 32-bit word: cpu_gemm.cpp's blocked_linear
    QUANTIZED = "quantized"  # GGUF blocks in tiles of 16 outputs: quantized_linear.py (cpu_quant_gemm.cpp)
    TRITON_QUANTIZED = "triton-quantized"  # GGUF blocks' fields on CUDA: triton_quant_gemm.py
    FP8 = "fp8"  # float8 weights and a scale an output: fp8_linear.py


@dataclass(frozen=True)
class HostKernels:
    """What this host's builds can run: the facts a layout decision takes besides the CPU's flags."""

    onednn: bool  # torch has oneDNN with ahead-of-time weight packing
    blocked: frozenset[torch.dtype]  # dtypes kvloom's blocked GEMM was built for (it needs AVX-512)

    @classmethod
    def here(cls) -> "HostKernels":
        onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        return cls(onednn, frozenset(d for d in (torch.float32, torch.bfloat16) if blocked_kernel_built(d)))


def gemm_extension():
    return build_extension("kvloom_cpu_gemm")


def blocked_kernel_built(dtype: torch.dtype) -> bool:
    """This host's build of the blocked GEMM has a kernel for `dtype` (it needs AVX-512)."""
    ops = gemm_extension()
    return ops is not None and ops.blocked_linear_supported(dtype)


def choose_layout(weight: torch.Tensor, isa: HostISA, kernels: HostKernels, shared: bool = False) -> Layout:
    """The layout a CPU weight runs fastest in, decided from the CPU's flags and the builds alone (nothing is
    run): kvloom's blocked kernel on an AVX-512 CPU without AMX tiles (AMX, through oneDNN, is several times
    faster than any vector kernel in bfloat16), bfloat16 with an even input width or float32; else oneDNN,
    packed, or reading the dense weight as it is (`shared`: it has another reader), in float32 or where the CPU
    multiplies bfloat16 in hardware (oneDNN emulates it elsewhere, slower than float32); else dense `F.linear`."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return Layout.DENSE
    even_words = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)
    if not shared and isa.avx512 and not isa.amx_bf16 and even_words and weight.dtype in kernels.blocked:
        return Layout.BLOCKED
    onednn_dtype = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and isa.fast_bfloat16)
    if kernels.onednn and onednn_dtype and (not shared or weight.is_contiguous()):
        return Layout.SHARED if shared else Layout.ONEDNN
    return Layout.DENSE


def host_layout(weight: torch.Tensor, shared: bool = False) -> Layout:
    """`choose_layout` for this host."""
    return choose_layout(weight, host_isa(), HostKernels.here(), shared)


def lay_out(weight: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The weight in `layout`: the one step that runs the chosen kernel's own packing code."""
    if layout is Layout.BLOCKED:
        return to_blocked(weight)
    if layout is Layout.ONEDNN:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
    return weight


def to_blocked(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K/E, 32, E] (E = 2 bfloat16 or 1 float32, a 32-bit word), N padded with zero
    rows: one 512-bit load holds 16 outputs' next word of inputs."""
    n, k = weight.shape
    per_word = 4 // weight.element_size()
    padded = torch.cat([weight, weight.new_zeros(-n % OUTPUT_BLOCK, k)]) if n % OUTPUT_BLOCK else weight
    return padded.view(-1, OUTPUT_BLOCK, k // per_word, per_word).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class PackedLinear:
    """y = x @ weight.T + bias for 2-D x, by the kernel its layout is for."""

    weight: torch.Tensor
    bias: torch.Tensor | None  # float32 for BLOCKED
    layout: Layout
    out_features: int

    @property
    def packed(self) -> bool:
        """The weight is a copy in a kernel's own layout (the loaded one can be released)."""
        return self.layout in (Layout.ONEDNN, Layout.BLOCKED)

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """A copy in the layout this host runs fastest (the loaded weight can then be released)."""
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        layout = host_layout(weight)
        if layout is Layout.BLOCKED and bias is not None:
            bias = bias.float().contiguous()
        return cls(lay_out(weight, layout), bias, layout, weight.shape[0])

    @classmethod
    def share(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """oneDNN on the dense weight itself, for a weight that is also read as it is (a tied LM head and
        embedding table): no second copy, at ~90% of the packed speed (576x49152 at 64 rows, measured)."""
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        return cls(weight, bias, host_layout(weight, shared=True), weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is Layout.BLOCKED:
            return torch.ops.kvloom.blocked_linear(x.contiguous(), self.weight, self.out_features, self.bias)
        if self.layout is Layout.DENSE:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
