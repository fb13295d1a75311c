"""Linear layers whose weights are laid out once for the CPU kernel that runs them best (float32 or bfloat16).

torch's eager `F.linear` on CPU is MKL's sgemm, which re-packs the weight on every call and is
weak at the row counts decode runs at. oneDNN with the weight packed ahead of time is much
faster there: measured on this project's 2-core AMD EPYC (Zen 3) hosts, at 64 rows the 576x3072
gate|up GEMM went 99 -> 155 GFLOP/s and the 576x49152 LM head 55 -> 120. At 2048 rows (a full
prefill step) MKL is up to 10% ahead on some shapes; decode steps dominate serving, so every
step uses the packed weight rather than holding both copies. In bfloat16 on a CPU with AMX tiles the
packed weight feeds them directly: on this project's Intel Xeon hosts, at 64 rows, 1.7-1.9x torch's
bfloat16 `F.linear` (1,880-2,240 vs 1,050-1,160 GFLOP/s) and 6x float32.

On other AVX-512 CPUs kvloom's own kernel (cpu_gemm.cpp) runs the weight laid out in blocks of 32 outputs
by 32-bit words of inputs (a pair of bfloat16 or one float32). With AVX512-BF16 dot products and no AMX (AMD
Zen 4), oneDNN's bfloat16 GEMM is weak below a few hundred rows: measured on the 2-core EPYC, SmolLM2's
linears at 16 rows 1.3-2x oneDNN's GFLOP/s, at 48 rows 1.0-1.6x, at 2048 rows on a par. Without bfloat16
units (a Xeon with AVX-512 only) oneDNN would emulate bfloat16, and the kernel widens the weights in
registers instead: they stream at half of float32's bytes for float32's math (SmolLM2's 30 layers at 1
row 10.7 ms against 17.1 in float32, at 48 rows 174 against 161 GFLOP/s); its float32 blocks beat oneDNN's
packed float32 there at decode's row counts (48 rows: 186-221 against 142-193 GFLOP/s, alternated, a noisy
host) and give up ~10% at 256 rows and more. Packed tensors are opaque (only their kernel reads them);
elsewhere (GPUs, float16, builds without oneDNN) the weight stays dense and `F.linear` runs as before.
"""

import enum
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension
from kvloom.kernels.host_isa import host_isa

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


def can_pack(weight: torch.Tensor) -> bool:
    dtype_ok = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and host_isa().fast_bfloat16)
    return (weight.device.type == "cpu" and dtype_ok and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def gemm_extension():
    return build_extension("kvloom_cpu_gemm")


def blocked_kernel_built(dtype: torch.dtype) -> bool:
    """This host's build of the blocked GEMM has a kernel for `dtype` (it needs AVX-512)."""
    ops = gemm_extension()
    return ops is not None and ops.blocked_linear_supported(dtype)


def blocked_fits(weight: torch.Tensor) -> bool:
    """kvloom's blocked kernel runs this weight and beats oneDNN here: on an AVX-512 CPU without AMX tiles
    (AMX, through oneDNN, is several times faster than any vector kernel in bfloat16, and oneDNN's float32
    there was not measured against this one), bfloat16 with an even input width or float32."""
    isa = host_isa()
    if not (weight.device.type == "cpu" and weight.dim() == 2 and isa.avx512 and not isa.amx_bf16):
        return False
    if not (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)):
        return False
    return blocked_kernel_built(weight.dtype)


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
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        if blocked_fits(weight):
            return cls(to_blocked(weight), None if bias is None else bias.float().contiguous(), Layout.BLOCKED,
                       weight.shape[0])
        if can_pack(weight):
            return cls(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT), bias,
                       Layout.ONEDNN, weight.shape[0])
        return cls(weight, bias, Layout.DENSE, weight.shape[0])

    @classmethod
    def share(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """oneDNN on the dense weight itself, for a weight that is also read as it is (a tied LM head and
        embedding table): no second copy, at ~90% of the packed speed (576x49152 at 64 rows, measured)."""
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        shared = can_pack(weight) and weight.is_contiguous()
        return cls(weight, bias, Layout.SHARED if shared else Layout.DENSE, weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is Layout.BLOCKED:
            return torch.ops.kvloom.blocked_linear(x.contiguous(), self.weight, self.out_features, self.bias)
        if self.layout is Layout.DENSE:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
