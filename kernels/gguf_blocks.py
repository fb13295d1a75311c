"""GGUF's quantized block types that kvloom runs as stored, and their fields: what a file's bytes mean.

A block holds 32 weights along the input: a float16 scale d, for Q4_1 a float16 min m, then the quants (Q4_0/Q4_1:
16 bytes of nibbles, byte i holding weight i low and weight i + 16 high; Q8_0: 32 int8). The kernels that read
them (quantized_linear.py on CPU, triton_quant_gemm.py on CUDA) and the tests' reference (`dequantize`) share this.
"""

import enum

import torch

BLOCK = 32  # weights along the input in a block


class QuantType(enum.IntEnum):
    """The GGUF block types kvloom runs as stored (values: GGML's type ids, as the gguf package's)."""

    Q4_0 = 2  # d f16, 16 bytes of nibbles: w = d * (q - 8)
    Q4_1 = 3  # d f16, m f16, 16 bytes of nibbles: w = d * q + m
    Q8_0 = 8  # d f16, 32 int8: w = d * q

    @property
    def block_bytes(self) -> int:
        return {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q8_0: 34}[self]

    @property
    def bits(self) -> int:
        return 8 if self is QuantType.Q8_0 else 4


def fields(blocks: torch.Tensor, qtype: QuantType) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """GGUF blocks [N, K/32 * block bytes] (uint8, as the file stores a tensor's rows) -> d [N, K/32] float16, m
    (Q4_1; Q4_0's is -8d; None for Q8_0) and q [N, K/32, 32] (nibbles 0..15 as uint8, or int8), q in input order."""
    n = blocks.shape[0]
    raw = blocks.contiguous().view(n, -1, qtype.block_bytes)
    d = raw[..., :2].contiguous().view(torch.float16)[..., 0]
    if qtype is QuantType.Q8_0:
        return d, None, raw[..., 2:].contiguous().view(torch.int8)
    m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0] if qtype is QuantType.Q4_1 else None
    nibbles = raw[..., 4:] if qtype is QuantType.Q4_1 else raw[..., 2:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # byte i: weight i (low nibble), weight i + 16 (high)
    if m is None:
        m = d.float().mul(-8).to(torch.float16)  # exact: a power of two, unless it overflows
        if not torch.isfinite(m).all():
            raise ValueError("a Q4_0 scale too large for a float16 min (|d| > 8188)")
    return d, m, q


def to_blocks(d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """`fields`' inverse: d [N, B] float16, m [N, B] float16 (Q4_1 only), q [N, B, 32] (nibbles 0..15 as uint8, or
    int8) -> GGUF blocks [N, B * block bytes] uint8, as a file stores them."""
    parts = [d.contiguous().view(torch.uint8).view(*d.shape, 2)]
    if qtype is QuantType.Q4_1:
        parts.append(m.contiguous().view(torch.uint8).view(*m.shape, 2))
    if qtype is QuantType.Q8_0:
        parts.append(q.contiguous().view(torch.uint8))
    else:
        parts.append(q[..., :16] | q[..., 16:] << 4)
    return torch.cat(parts, dim=-1).flatten(1)


def dequantize(blocks: torch.Tensor, qtype: QuantType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF blocks [N, K/32 * block bytes] -> the weight [N, K] in `dtype`, in plain torch (the reference)."""
    d, m, q = fields(blocks, qtype)
    weight = d.to(dtype)[..., None] * q.to(dtype)
    if m is not None:
        weight = weight + m.to(dtype)[..., None]
    return weight.reshape(blocks.shape[0], -1)
