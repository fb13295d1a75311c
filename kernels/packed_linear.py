"""Linear layers whose weights are laid out once for the CPU kernel that runs them best (float32 or bfloat16).

torch's eager `F.linear` on CPU is MKL's sgemm, which re-packs the weight on every call and is
weak at the row counts decode runs at. oneDNN with the weight packed ahead of time is much
faster there: measured on this project's 2-core AMD EPYC (Zen 3) hosts, at 64 rows the 576x3072
gate|up GEMM went 99 -> 155 GFLOP/s and the 576x49152 LM head 55 -> 120. At 2048 rows (a full
prefill step) MKL is up to 10% ahead on some shapes; decode steps dominate serving, so every
step uses the packed weight rather than holding both copies. In bfloat16 on a CPU with AMX tiles the
packed weight feeds them directly: on this project's Intel Xeon hosts, at 64 rows, 1.7-1.9x torch's
bfloat16 `F.linear` (1,880-2,240 vs 1,050-1,160 GFLOP/s) and 6x float32. On a CPU with AVX512-BF16 dot
products and no AMX (AMD Zen 4), oneDNN's bfloat16 GEMM is weak below a few hundred rows, and kvloom's own
kernel (cpu_gemm.cpp) runs the weight laid out in pairs of inputs: measured on the 2-core EPYC, SmolLM2's
linears at 16 rows 1.3-2x oneDNN's GFLOP/s, at 48 rows 1.0-1.6x, at 2048 rows on a par. On a CPU without
bfloat16 hardware oneDNN would emulate it, so bfloat16 weights stay dense there. Packed tensors are opaque
(only their kernel reads them); elsewhere (GPUs, float16, builds without oneDNN) the weight stays dense and
`F.linear` runs as before.
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


PAIR_BLOCK = 32  # outputs per block of the pairs layout (cpu_gemm.cpp's BLOCK_N)


class Layout(enum.Enum):
    DENSE = "dense"    # [out, in] as loaded, run by F.linear
    SHARED = "shared"  # [out, in], read as it is by oneDNN (shared with another reader)
    ONEDNN = "onednn"  # oneDNN's blocked layout
    PAIRS = "pairs"    # [ceil(out/32), in/2, 32, 2] bfloat16, cpu_gemm.cpp's pair_linear


def can_pack(weight: torch.Tensor) -> bool:
    dtype_ok = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and host_isa().fast_bfloat16)
    return (weight.device.type == "cpu" and dtype_ok and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def gemm_extension():
    return build_extension("kvloom_cpu_gemm")


def pairs_fit(weight: torch.Tensor) -> bool:
    """kvloom's pair kernel runs this weight and beats oneDNN here: bfloat16 on AVX512-BF16 without AMX
    (AMX tiles, through oneDNN, are several times faster than any dot-product kernel), an even input width."""
    isa = host_isa()
    if not (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and isa.avx512_bf16 and not isa.amx_bf16):
        return False
    ops = gemm_extension()
    return ops is not None and ops.pair_linear_supported()


def to_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K/2, 32, 2], N padded with zero rows: one 512-bit load holds 16 outputs' next
    two weights."""
    n, k = weight.shape
    padded = torch.cat([weight, weight.new_zeros(-n % PAIR_BLOCK, k)]) if n % PAIR_BLOCK else weight
    return padded.view(-1, PAIR_BLOCK, k // 2, 2).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class PackedLinear:
    """y = x @ weight.T + bias for 2-D x, by the kernel its layout is for."""

    weight: torch.Tensor
    bias: torch.Tensor | None  # float32 for PAIRS
    layout: Layout
    out_features: int

    @property
    def packed(self) -> bool:
        """The weight is a copy in a kernel's own layout (the loaded one can be released)."""
        return self.layout in (Layout.ONEDNN, Layout.PAIRS)

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        if pairs_fit(weight):
            return cls(to_pairs(weight), None if bias is None else bias.float().contiguous(), Layout.PAIRS,
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
        if self.layout is Layout.PAIRS:
            return torch.ops.kvloom.pair_linear(x.contiguous(), self.weight, self.out_features, self.bias)
        if self.layout is Layout.DENSE:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
