"""An AutoAWQ checkpoint (`quant_method: awq`, version `gemm`: the 4-bit format most AWQ models on the Hub ship in),
read as stored; integer_weights.py runs it.

A quantized linear stores `qweight` int32 [K, N / 8] (inputs by rows, eight outputs a word), `qzeros` int32
[K / g, N / 8] and `scales` [K / g, N], w[k, n] = s * (u - z) with u and z unsigned 4-bit. A word's nibble i (bits
4i) holds output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i] of its column c: AutoAWQ's packing order for its GPU kernel.
"""

import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.model.integer_weights import IntegerCheckpoint, Integers, WeightScheme

NIBBLE_OF_OUTPUT = [0, 4, 1, 5, 2, 6, 3, 7]  # output 8c + j is nibble NIBBLE_OF_OUTPUT[j] of word c


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AutoAWQ's order -> the unsigned nibbles [R, C] in output order (int16)."""
    nibbles = (words.to(torch.int32)[..., None] >> (torch.arange(8, dtype=torch.int32) * 4)) & 15
    return nibbles[..., NIBBLE_OF_OUTPUT].flatten(-2).to(torch.int16)


def open_awq(checkpoint: Checkpoint, config: dict) -> "AwqCheckpoint":
    """`checkpoint` read through its `quantization_config` (AutoAWQ)."""
    if config.get("bits", 4) != 4 or str(config.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(f"AWQ {config.get('bits')}-bit version {config.get('version')!r}: kvloom reads 4-bit "
                             "gemm checkpoints")
    scheme = WeightScheme(4, symmetric=not config.get("zero_point", True))
    return AwqCheckpoint(checkpoint, {name.removesuffix(".qweight"): scheme for name in checkpoint.files
                                      if name.endswith(".qweight")})


class AwqCheckpoint(IntegerCheckpoint):
    method = "awq"

    def integers(self, prefix: str) -> Integers:
        q = unpack_awq(self.raw(f"{prefix}.qweight")).T - 8  # [N, K], signed
        scale = self.raw(f"{prefix}.scales").T
        zero = None if self.schemes[prefix].symmetric else (unpack_awq(self.raw(f"{prefix}.qzeros")).T - 8).contiguous()
        return Integers(q.contiguous(), scale.contiguous(), zero)
