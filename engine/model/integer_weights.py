"""A checkpoint whose linears store integer weights with scales (and zero points): w = s * (q - z), a scale and zero
point per output channel or per group of inputs. Its readers (compressed_tensors.py, awq.py, gptq.py) only say where
each linear's q, s and z are; this turns them into what the decoder runs.

kvloom's GEMM reads blocks of 32 inputs with a float16 scale d and min m, so a group of g inputs becomes g/32 blocks
with the group's scale: 4-bit symmetric as Q4_0 (the nibble q + 8, d = s: exact), 4-bit with zero points as Q4_1 (d
= s, m = -s * (z + 8) rounded to float16: within half a float16 step of it, where the checkpoint's own
de-quantization rounds w to its scales' dtype), 8-bit symmetric as Q8_0 (exact). A linear whose scales float16
cannot hold (float32 scales, or below float16's normal range), whose groups are not whole blocks of consecutive
inputs, or 8-bit with zero points, is de-quantized, said once at start; so is every linear where the decoder reads
weights densely (tensor-parallel ranks), through `get`.
"""

import logging
from dataclasses import dataclass

import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.kernels.gguf_blocks import BLOCK, QuantType, to_blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightScheme:
    """How a linear stores its weights, and whether its inputs are quantized to int8."""

    num_bits: int
    symmetric: bool
    int8_activations: bool = False

    def qtype(self) -> QuantType | None:
        """The GGUF block type holding these weights, if one does."""
        if self.num_bits == 4:
            return QuantType.Q4_0 if self.symmetric else QuantType.Q4_1
        return QuantType.Q8_0 if self.symmetric else None


@dataclass(frozen=True)
class Integers:
    """One linear as stored: q [N, K] (int16, signed: q = stored - 2^(bits-1)), scales [N, G] and zero points [N, G]
    on the same signed scale (None: symmetric). The groups are K / G consecutive inputs, or where `group_of` [K] is
    given, input k is in group group_of[k] (activation order: `input_groups`)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_of: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.group_of is None and self.q.shape[1] % self.scale.shape[1]:
            raise ModelLoadError(f"{self.q.shape[1]} inputs in {self.scale.shape[1]} groups: kvloom reads groups of "
                                 "equal size")

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def per_input(self, values: torch.Tensor) -> torch.Tensor:
        """[N, G] -> [N, K]: each input's group's value."""
        if self.group_of is not None:
            return values[:, self.group_of]
        return values.repeat_interleave(self.group, 1)

    def dequantized(self) -> torch.Tensor:
        """s * (q - z) in float32: exact for 16-bit scales (11 significant bits times |q - z| < 2^9), rounded once
        for float32 ones; the caller rounds once more to its dtype."""
        steps = self.q if self.zero is None else self.q - self.per_input(self.zero)
        return steps.float() * self.per_input(self.scale.float())


def unpack(words: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """int32 words [R, ceil(C * bits / 32)] -> the integers [R, C] (int16, signed: q = stored - 2^(bits-1)), as
    compressed-tensors and GPTQ pack them; 4 and 8 bits divide a word, so element i is word i * bits // 32, bit
    i * bits % 32."""
    shifts = torch.arange(32 // num_bits, dtype=torch.int32) * num_bits
    values = (words.to(torch.int32)[..., None] >> shifts) & ((1 << num_bits) - 1)
    return values.flatten(-2)[..., :columns].to(torch.int16) - (1 << (num_bits - 1))


def input_groups(g_idx: torch.Tensor, inputs: int, groups: int, size: int, name: str) -> torch.Tensor | None:
    """A stored g_idx (input k's group: GPTQ's `g_idx`, compressed-tensors' `weight_g_idx`) checked, or None where it
    only says what Integers assumes without one: runs of `size` inputs dividing them evenly."""
    group_of = g_idx.long()
    if group_of.shape != (inputs,) or group_of.min() < 0 or group_of.max() >= groups:
        raise ModelLoadError(f"{name} does not give each of its {inputs} inputs one of its {groups} groups")
    runs = inputs % size == 0 and torch.equal(group_of, torch.arange(inputs) // size)
    return None if runs else group_of


class IntegerCheckpoint(Checkpoint):
    """The checkpoint with each quantized linear's `<name>.weight` de-quantized when read, and its GGUF blocks for
    kvloom's quantized GEMM (`blocks`, as engine/model/quantized_weights.py's for a GGUF model). Subclasses find the
    quantized linears (`schemes`) and read each one's `integers`."""

    method = ""  # the `quantization` value (vLLM's name) that runs it as stored

    def __init__(self, checkpoint: Checkpoint, schemes: dict[str, WeightScheme]) -> None:
        super().__init__(checkpoint.model_dir, checkpoint.files, checkpoint.dtype, checkpoint.device)
        self.schemes = schemes  # by linear name: the quantized linears
        self.dense_reasons: dict[str, str] = {}

    def integers(self, prefix: str) -> Integers:
        raise NotImplementedError

    def _prefix(self, name: str) -> str | None:
        prefix = name.removesuffix(".weight")
        return prefix if prefix != name and prefix in self.schemes else None

    def __contains__(self, name: str) -> bool:
        return self._prefix(name) is not None or super().__contains__(name)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        prefix = self._prefix(name)
        if prefix is None:
            return super().get(name, dtype)
        return self.integers(prefix).dequantized().to(device=self.device, dtype=dtype or self.dtype)

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._prefix(name) is None:
            return super().get_slice(name, dim, start, end, dtype)
        weight = self.get(name, dtype)
        return (weight[start:end] if dim == 0 else weight[:, start:end]).contiguous()

    def int8_activations(self, names: list[str]) -> bool:
        """A linear computing several side by side takes int8 activations where any of them does."""
        return any(self.schemes[prefix].int8_activations for name in names if (prefix := self._prefix(name)))

    def blocks(self, names: list[str]) -> tuple[torch.Tensor, QuantType] | None:
        """The weights `names` (side by side, as one linear computes them) as rows of GGUF blocks, if each is held
        by one type (see above); else None, and it runs de-quantized."""
        converted = [self._blocks(name) for name in names]
        kinds = {c[1] if c else None for c in converted}
        if len(kinds) > 1 and None not in kinds:  # computed side by side, they need one block type
            types = " and ".join(sorted(kind.name for kind in kinds))
            for name in names:
                self._dense(name.removesuffix(".weight"), f"parts stored as {types}")
        if len(kinds) != 1 or None in kinds:
            return None
        rows = [c[0] for c in converted]
        return (torch.cat(rows) if len(rows) > 1 else rows[0]), kinds.pop()

    def _blocks(self, name: str) -> tuple[torch.Tensor, QuantType] | None:
        prefix = self._prefix(name)
        if prefix is None:
            return None
        qtype = self.schemes[prefix].qtype()
        if qtype is None:
            return self._dense(prefix, "8-bit with zero points")
        stored = self.integers(prefix)
        if stored.group_of is not None:
            return self._dense(prefix, "inputs grouped by g_idx (activation order), not in runs of a group's size")
        if stored.group % BLOCK:
            return self._dense(prefix, f"groups of {stored.group} inputs (not whole blocks of {BLOCK})")
        d = stored.scale.to(torch.float16)
        if not torch.equal(d.to(stored.scale.dtype), stored.scale):
            return self._dense(prefix, f"{stored.scale.dtype} scales that float16 does not hold")
        per_group = stored.group // BLOCK
        d = d.repeat_interleave(per_group, 1)
        q = stored.q.view(stored.q.shape[0], -1, BLOCK)
        if qtype is QuantType.Q8_0:
            return to_blocks(d, None, q.to(torch.int8), qtype), qtype
        m = None
        if stored.zero is not None:  # d * (q + 8) + m = s * (q - z)
            m = (-stored.scale.float() * (stored.zero + 8)).repeat_interleave(per_group, 1).to(torch.float16)
            if not torch.isfinite(m).all():
                return self._dense(prefix, "mins s * (z + 8) beyond float16")
        return to_blocks(d, m, (q + 8).to(torch.uint8), qtype), qtype

    def _dense(self, prefix: str, reason: str) -> None:
        self.dense_reasons[prefix] = reason
        return None

    def log_inflated(self) -> None:
        """One line naming why the linears that run de-quantized do (called once the decoder is built)."""
        by_reason: dict[str, list[str]] = {}
        for prefix, reason in self.dense_reasons.items():
            by_reason.setdefault(reason, []).append(prefix)
        if by_reason:
            logger.info("quantization %s: %s run de-quantized", self.method, "; ".join(
                f"{len(names)} linear(s) ({names[0]}, ...) for {reason}" for reason, names in by_reason.items()))
