"""Linears with float8 weights quantized at load (`quantization: fp8`, vLLM's dynamic FP8 for a 16-bit checkpoint).

Each output channel's weights are scaled by their largest magnitude over 448 (float8_e4m3fn's largest finite value)
and stored in one byte; each row of x is scaled the same way on every call (per-token dynamic activation scales),
and `torch._scaled_mm` multiplies the two in FP8, sums in float32, applies both scales and rounds once to bfloat16.
On Ada and Hopper GPUs (compute capability 8.9 and up) that is the FP8 tensor cores: half the weight bytes of
bfloat16 and twice its peak. Elsewhere the engine refuses it: torch also runs `_scaled_mm` on CPU, which is how
the tests check the arithmetic and the engine's plumbing, but as a slow reference (measured in
docs/performance.md), not a fast path.
"""

from dataclasses import dataclass

import torch

from kvloom.kernels.packed_linear import Layout

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
TENSOR_CORE_CAPABILITY = (8, 9)  # Ada; Hopper is (9, 0)
DIM_MULTIPLE = 16  # _scaled_mm's rule for both dims of the weight on CUDA


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 linears cannot run on `device`, or None where they can."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < TENSOR_CORE_CAPABILITY:
            return (f"FP8 weights need FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                    f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
        return None
    return (f"FP8 weights need FP8 tensor cores (a CUDA GPU of compute capability 8.9 or newer), which {device.type} "
            f"lacks: torch's {device.type} FP8 matrix multiply is a slow reference. Use quantization: gguf on CPUs")


def runs_in_fp8(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight has the shape `_scaled_mm` takes (else it stays in the model's dtype)."""
    return weight.shape[0] % DIM_MULTIPLE == 0 and weight.shape[1] % DIM_MULTIPLE == 0


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (float8 [R, C], float32 scales [R, 1]) with t ~ float8 * scale, each row's largest value 448."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (t.float() / scale).to(FP8), scale


@dataclass(frozen=True)
class Fp8Linear:
    """y = x @ W.T + bias for 2-D x (bfloat16 or float32), W in float8 with a scale an output. Used as a
    `PackedLinear` is."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [1, N] float32: W ~ weight * scale.T
    bias: torch.Tensor | None
    out_features: int
    layout: Layout = Layout.FP8

    @property
    def packed(self) -> bool:
        """The weight is a copy of its own (the loaded one can be released)."""
        return True

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8Linear":
        """From a [N, K] weight in the model's dtype, on the device it runs on (see `runs_in_fp8`)."""
        quantized, scale = quantize_rows(weight.detach())
        return cls(quantized, scale.t().contiguous(), None if bias is None else bias.detach(), weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_scale = quantize_rows(x)
        y = torch._scaled_mm(rows, self.weight.t(), scale_a=row_scale, scale_b=self.scale, out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias
