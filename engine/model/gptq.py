"""A GPTQ checkpoint (`quant_method: gptq`, as AutoGPTQ and GPTQModel write it: most int4 models on the Hub), read as
stored; integer_weights.py runs it.

A quantized linear stores `qweight` int32 [K * bits / 32, N] (inputs packed down the columns: input k at bit
(k % (32 / bits)) * bits of row k // (32 / bits)), `qzeros` int32 [G, N * bits / 32] (outputs packed along the rows
the same way), `scales` [G, N] and `g_idx` [K] (input k's group): w[n, k] = s[g, n] * (u - z[g, n]), g = g_idx[k], u
and z unsigned. Format `gptq` (AutoGPTQ's, and GPTQModel's default) stores each zero point less one, subtracted from
the packed word as a whole (0x11111111 for 4 bits, borrows included), so the word gets it back before it is unpacked;
`gptq_v2` (GPTQModel's other) stores them as they are. kvloom reads 4- and 8-bit int32 packing in consecutive groups
(g_idx[k] = k // group size) as GGUF blocks; a linear whose inputs are grouped by activation order (`desc_act`:
g_idx permuted) runs de-quantized, said once. What would read as other weights is refused by name (`open_gptq`).
"""

import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.model.integer_weights import IntegerCheckpoint, Integers, WeightScheme, input_groups, unpack

FORMATS = ("gptq", "gptq_v2")
V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # what format gptq took off each packed word of zero points


def int32_bits(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (any integer dtype, taken modulo 2^32) -> the int32 tensor holding those bits."""
    words = words.to(torch.int64) % (1 << 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def open_gptq(checkpoint: Checkpoint, config: dict) -> "GptqCheckpoint":
    """`checkpoint` read through its `quantization_config` (GPTQ). Refused by name, since they would read as other
    weights: other bit widths, packings and layouts (marlin, bitblas, planar), GPTQModel's per-module overrides
    (`dynamic`, except entries that only leave modules unquantized), rotations folded into the weights (`rotation`)
    and quantized activations (`activation`)."""
    bits = config.get("bits", 4)
    named = {str(config[key]).lower() for key in ("format", "checkpoint_format") if config.get(key)}
    if len(named) > 1:
        raise ModelLoadError(f"GPTQ: format and checkpoint_format disagree ({' and '.join(sorted(named))})")
    layout = named.pop() if named else "gptq"
    words = str(config.get("pack_dtype", "int32")).removeprefix("torch.")
    if bits not in (4, 8) or layout not in FORMATS or words != "int32" or config.get("is_marlin_format"):
        raise ModelLoadError(f"GPTQ {bits}-bit format {layout!r} packed in {words}: kvloom reads 4- and 8-bit "
                             f"{' and '.join(FORMATS)} packed in int32")
    if any(not key.startswith("-:") for key in config.get("dynamic") or {}):
        raise ModelLoadError("GPTQ with per-module overrides (dynamic): kvloom reads one scheme for every linear")
    for key in ("rotation", "activation"):
        if config.get(key):
            raise ModelLoadError(f"GPTQ with {key} {config[key]!r}: kvloom reads weight-only GPTQ without rotations")
    group_size = config.get("group_size", 128)
    scheme = WeightScheme(bits, symmetric=bool(config.get("sym", True)))
    return GptqCheckpoint(checkpoint, {name.removesuffix(".qweight"): scheme for name in checkpoint.files
                                       if name.endswith(".qweight")}, layout == "gptq", group_size)


class GptqCheckpoint(IntegerCheckpoint):
    """The linears' integers unpacked from GPTQ's words (above), their zero points given back what format gptq took
    off them, and g_idx kept where it groups inputs other than in runs of `group_size`."""

    method = "gptq"

    def __init__(self, checkpoint: Checkpoint, schemes: dict[str, WeightScheme], zeros_less_one: bool,
                 group_size: int) -> None:
        super().__init__(checkpoint, schemes)
        self.zeros_less_one = zeros_less_one
        self.group_size = group_size  # -1: one group of every input (a scale an output channel)

    def integers(self, prefix: str) -> Integers:
        bits = self.schemes[prefix].num_bits
        words = self.raw(f"{prefix}.qweight")
        q = unpack(words.T.contiguous(), bits, words.shape[0] * 32 // bits)  # [N, K]
        scale = self.raw(f"{prefix}.scales").T.contiguous()  # [N, G]
        group_of = self._group_of(prefix, q.shape[1], scale.shape[1])
        zero_words = self.raw(f"{prefix}.qzeros")
        if self.zeros_less_one:
            zero_words = int32_bits(zero_words.to(torch.int64) + V1_ZERO_OFFSET[bits])
        zero = unpack(zero_words, bits, q.shape[0]).T.contiguous()  # [N, G], signed as q
        if not self.schemes[prefix].symmetric:
            return Integers(q, scale, zero, group_of)
        if zero.any():
            raise ModelLoadError(f"GPTQ: {prefix}'s zero points are not {1 << (bits - 1)}, which its config's sym "
                                 "says they are")
        return Integers(q, scale, None, group_of)

    def _group_of(self, prefix: str, inputs: int, groups: int) -> torch.Tensor | None:
        """Each input's group where g_idx says other than runs of group_size inputs (activation order), else None."""
        if f"{prefix}.g_idx" not in self:
            return None
        size = inputs if self.group_size == -1 else self.group_size
        return input_groups(self.raw(f"{prefix}.g_idx"), inputs, groups, size, f"GPTQ: {prefix}.g_idx")
