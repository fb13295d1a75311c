"""Linear layers whose weights stay GGUF-quantized (Q4_1, Q4_0, Q8_0): run as the file stores them, not inflated.

At low batch a decode step is a read of every weight, so the bytes read set its time: Q4_1 holds a weight in 0.625
bytes and Q8_0 in 1.0625, against bfloat16's 2. The blocks (32 weights along the input, a float16 scale d, Q4_1 a
float16 min m too) are packed once at load (`pack`) into tiles of 16 outputs by one block, which kvloom's kernel
(cpu_quant_gemm.cpp) reads once per call, dequantizing in registers: activations float32 or bfloat16, sums float32.
Calls of many bfloat16 rows, which are compute-bound, de-quantize the tiles to bfloat16 in cache instead and run
kvloom's bfloat16 GEMM on them: the de-quantized model's arithmetic at its speed. The tile layout and its math are
described there. Where that kernel cannot be built (no compiler) or off the CPU,
the weight is dequantized once (`dequantize`, also the tests' reference) and runs dense, as `PackedLinear` does.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension
from kvloom.kernels.gguf_blocks import QuantType, dequantize, fields
from kvloom.kernels.packed_linear import Layout

if TYPE_CHECKING:
    from kvloom.kernels.triton_quant_gemm import TritonQuantWeight

TILE_OUTPUTS = 16  # outputs per packed tile (cpu_quant_gemm.cpp's TILE_N)


def quant_kernel(variant: str | None = None):
    """`torch.ops.kvloom` with the quantized GEMM built for this CPU, or for an ISA variant (cpu_extensions); None
    where it cannot be built."""
    return build_extension("kvloom_cpu_quant", variant)


def int8_dots(variant: str | None = None) -> bool:
    """Whether the kernel build runs int8 activations (VNNI): only there are tiles packed in its int8 layout."""
    ops = quant_kernel(variant)
    if ops is None:
        return False
    path = getattr(ops, f"quant_linear_path_{variant}" if variant else "quant_linear_path")
    return path(4, torch.bfloat16, 1, True) == "avx512vnni-int8"


def pack(blocks: torch.Tensor, qtype: QuantType, int8: bool = False) -> torch.Tensor:
    """GGUF blocks [N, K/32 * block bytes] -> tiles [ceil(N/16), K/32, 320 (Q4_1, Q4_0) or 544 (Q8_0)] uint8,
    cpu_quant_gemm.cpp's layout (`int8`: its int8 kernel's); N padded with zero weights."""
    d, m, q = fields(blocks, qtype)
    pad = -d.shape[0] % TILE_OUTPUTS

    def tiled(t: torch.Tensor) -> torch.Tensor:  # [N, B, ...] -> [T, 16 outputs, B, ...], zero outputs padding N
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.view(-1, TILE_OUTPUTS, *t.shape[1:])

    def scale_bytes(scale: torch.Tensor) -> torch.Tensor:  # [N, B] float16 -> [T, B, 32] (16 outputs' scales)
        return tiled(scale).transpose(1, 2).contiguous().view(torch.uint8)

    def chunks(t: torch.Tensor, width: int) -> torch.Tensor:  # [T, j, B, width c + i] -> [T, B, chunk c: j, i]
        return t.unflatten(-1, (-1, width)).permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).flatten(2)

    q = tiled(q)  # [T, 16 outputs j, B, 32 inputs]
    if qtype is QuantType.Q8_0:  # chunk p: output j's inputs 2p+e (byte 2j+e); int8: 4p+b, plus 128 (byte 4j+b)
        weights = chunks((q.to(torch.int16) + 128).to(torch.uint8), 4) if int8 else chunks(q, 2)
        return torch.cat([scale_bytes(d), weights], dim=-1)
    # chunk c: output j's input 2c+e in the low nibble, 2c+16+e in the high (byte 2j+e); int8: 4c+b (byte 4j+b)
    return torch.cat([scale_bytes(d), scale_bytes(m), chunks(q[..., :16] | q[..., 16:] << 4, 4 if int8 else 2)],
                     dim=-1)


@dataclass(frozen=True)
class QuantizedLinear:
    """y = x @ W.T + bias for 2-D x (float32 or bfloat16), W given as GGUF blocks: kvloom's CPU kernel on its packed
    tiles, the Triton kernels on CUDA, or dense where neither runs. Used as a `PackedLinear` is."""

    weight: "torch.Tensor | TritonQuantWeight"  # tiles (QUANTIZED), the GGUF fields (TRITON), or dequantized (DENSE)
    bias: torch.Tensor | None  # float32 for QUANTIZED
    qtype: QuantType
    layout: Layout
    out_features: int
    variant: str | None = None  # the kernel build that runs it: this CPU's own, or an ISA variant (tests)
    int8: bool = False  # tiles in the int8 kernel's layout: x runs in int8 (CPU kernel, where VNNI is)

    @property
    def packed(self) -> bool:
        """The weight is a copy in a kernel's own layout (the loaded one can be released)."""
        return self.layout in (Layout.QUANTIZED, Layout.TRITON_QUANTIZED)

    @classmethod
    def pack(cls, blocks: torch.Tensor, qtype: QuantType, dtype: torch.dtype, bias: torch.Tensor | None = None,
             variant: str | None = None, device: torch.device = torch.device("cpu"), int8: bool = False
             ) -> "QuantizedLinear":
        """From a tensor's GGUF blocks [N, K/32 * block bytes] on the host, for activations of `dtype` on `device`:
        on CUDA the blocks' fields for the Triton kernel; on CPU packed tiles where kvloom's kernel runs (`int8`:
        bfloat16 activations quantized to int8 where the build has VNNI, exact elsewhere); elsewhere the weight
        dequantized to `dtype` on `device` (done once here)."""
        if device.type == "cuda":
            return cls.for_triton(blocks, qtype, bias, device)
        if device.type != "cpu" or quant_kernel(variant) is None:
            bias = None if bias is None else bias.detach().to(device, dtype)
            return cls(dequantize(blocks, qtype, dtype).to(device), bias, qtype, Layout.DENSE, blocks.shape[0])
        bias = None if bias is None else bias.detach().float().contiguous()
        int8 = int8 and dtype == torch.bfloat16 and int8_dots(variant)
        return cls(pack(blocks, qtype, int8), bias, qtype, Layout.QUANTIZED, blocks.shape[0], variant, int8)

    @classmethod
    def for_triton(cls, blocks: torch.Tensor, qtype: QuantType, bias: torch.Tensor | None, device: torch.device
                   ) -> "QuantizedLinear":
        """The Triton kernel's layout on `device` (CUDA; the CPU under Triton's interpreter in tests)."""
        from kvloom.kernels.triton_quant_gemm import TritonQuantWeight

        bias = None if bias is None else bias.detach().float().to(device)
        return cls(TritonQuantWeight.of(blocks, qtype, device), bias, qtype, Layout.TRITON_QUANTIZED,
                   blocks.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is Layout.DENSE:
            return F.linear(x, self.weight, self.bias)
        if self.layout is Layout.TRITON_QUANTIZED:
            from kvloom.kernels.triton_quant_gemm import quant_matmul

            return quant_matmul(x, self.weight, self.bias)
        op = getattr(torch.ops.kvloom, f"quant_linear_{self.variant}" if self.variant else "quant_linear")
        return op(x.contiguous(), self.weight, self.qtype.bits, self.out_features, self.bias, self.int8)
