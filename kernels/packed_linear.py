"""Linear layers whose weights are reordered once into oneDNN's blocked layout (CPU, float32 or bfloat16).

torch's eager `F.linear` on CPU is MKL's sgemm, which re-packs the weight on every call and is
weak at the row counts decode runs at. oneDNN with the weight packed ahead of time is much
faster there: measured on this project's 2-core AMD EPYC (Zen 3) hosts, at 64 rows the 576x3072
gate|up GEMM went 99 -> 155 GFLOP/s and the 576x49152 LM head 55 -> 120. At 2048 rows (a full
prefill step) MKL is up to 10% ahead on some shapes; decode steps dominate serving, so every
step uses the packed weight rather than holding both copies. In bfloat16 on a CPU with AMX tiles the
packed weight feeds them directly: on this project's Intel Xeon hosts, at 64 rows, 1.7-1.9x torch's
bfloat16 `F.linear` (1,880-2,240 vs 1,050-1,160 GFLOP/s) and 6x float32. On a CPU without bfloat16
hardware oneDNN would emulate it, so bfloat16 weights stay dense there. The packed tensor is opaque
(only oneDNN reads it); elsewhere (GPUs, float16, builds without oneDNN) the weight stays dense and
`F.linear` runs as before.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.kernels.host_isa import host_isa

PACK_ROWS_HINT = 64  # the row count oneDNN picks its weight layout for; any row count works after
# oneDNN builds a GEMM primitive per row count, and both its cache and ideep's hold up to 1024 of them,
# ~0.6 MB each: a run visiting every decode batch size 1..64 kept ~150 MB. A step needs five (one per
# weight shape), so 32 keeps the last few batch sizes; a rebuild costs ~1-2 ms. Read at first use.
PRIMITIVE_CACHE_CAPACITY = "32"
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, PRIMITIVE_CACHE_CAPACITY)


def can_pack(weight: torch.Tensor) -> bool:
    dtype_ok = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and host_isa().fast_bfloat16)
    return (weight.device.type == "cpu" and dtype_ok and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@dataclass(frozen=True)
class PackedLinear:
    """y = x @ weight.T + bias for 2-D x, through oneDNN where it can run (weight packed or shared)."""

    weight: torch.Tensor  # oneDNN's blocked layout when `packed`, else dense [out, in]
    bias: torch.Tensor | None
    packed: bool
    onednn: bool  # run by oneDNN (packed, or dense and shared with other readers), else F.linear

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        if can_pack(weight):
            return cls(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT), bias, True, True)
        return cls(weight, bias, False, False)

    @classmethod
    def share(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """oneDNN on the dense weight itself, for a weight that is also read as it is (a tied LM head and
        embedding table): no second copy, at ~90% of the packed speed (576x49152 at 64 rows, measured)."""
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        return cls(weight, bias, False, can_pack(weight) and weight.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
