"""A compressed-tensors checkpoint (what llm-compressor writes and vLLM runs: W4A16, W8A16, W8A8 in integers), its
quantized linears run by kvloom's quantized GEMM as GGUF blocks, or de-quantized on read.

config.json's `quantization_config` (`quant_method: compressed-tensors`) says, per group of linears, how their
weights are stored: integers of `num_bits`, a scale per output channel or per group of `group_size` inputs, and
where asymmetric an integer zero point: w = s * (q - z). Format `pack-quantized` packs the integers into int32
words along the input (weight i of each 32 at bit i * bits, as q + 2^(bits - 1)), `int-quantized` keeps int8.

kvloom's GEMM reads blocks of 32 inputs with a float16 scale d and min m, so a group of g inputs becomes g/32
blocks with the group's scale: 4-bit symmetric as Q4_0 (the nibble q + 8, d = s: exact), 4-bit asymmetric as Q4_1
(d = s, m = -s * (z + 8) rounded to float16: within 2^-11 of it, where the checkpoint's own de-quantization rounds
w to its scales' dtype), 8-bit symmetric as Q8_0 (exact). A linear whose scales float16 cannot hold (float32 scales,
or below float16's normal range), whose groups are not whole blocks, or 8-bit asymmetric, is de-quantized, said
once. Activations quantized to int8 by the scheme (W8A8) run kvloom's int8 activations (quantized_linear.py).
"""

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.kernels.gguf_blocks import BLOCK, QuantType, to_blocks

logger = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightScheme:
    """How one group of linears stores its weights, and whether their inputs are quantized to int8."""

    num_bits: int
    symmetric: bool
    group_size: int | None  # None: a scale per output channel
    int8_activations: bool

    @classmethod
    def of(cls, group: dict) -> "WeightScheme":
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8):
            raise ModelLoadError(f"compressed-tensors weights {weights}: kvloom runs 4- and 8-bit integers")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("group", "channel"):
            raise ModelLoadError(f"compressed-tensors weight strategy {strategy!r}: kvloom runs group and channel")
        return cls(weights["num_bits"], weights.get("symmetric", True),
                   weights.get("group_size") if strategy == "group" else None,
                   bool(inputs) and inputs.get("type", "int") == "int" and inputs.get("num_bits") == 8)

    def qtype(self) -> QuantType | None:
        """The GGUF block type holding these weights, if one does."""
        if self.num_bits == 4:
            return QuantType.Q4_0 if self.symmetric else QuantType.Q4_1
        return QuantType.Q8_0 if self.symmetric else None


def _matches(name: str, patterns: list[str]) -> bool:
    """compressed-tensors' targets: `re:` a regex matched from the module name's start, a class name (`Linear`:
    every linear), or the name itself."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p == "Linear" or p == name or name.endswith(f".{p}")
               for p in patterns)


def unpack(words: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """int32 words [R, ceil(C * bits / 32)] -> the integers [R, C] (int16, signed: q), as pack-quantized stores
    them; 4 and 8 bits divide a word, so element i is word i * bits // 32, bit i * bits % 32."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32) * num_bits
    values = (words.to(torch.int32)[..., None] >> shifts) & ((1 << num_bits) - 1)
    return values.flatten(-2)[..., :columns].to(torch.int16) - (1 << (num_bits - 1))


def open_checkpoint(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Checkpoint | None:
    """The directory's safetensors checkpoint; a CompressedCheckpoint where config.json says compressed-tensors."""
    checkpoint = Checkpoint.open(model_dir, dtype, device)
    config = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    if checkpoint is None or config.get("quant_method") != "compressed-tensors":
        return checkpoint
    groups = config.get("config_groups") or {}
    formats = {group.get("format") or config.get("format") for group in groups.values()}
    if not formats or not formats <= set(FORMATS):
        raise ModelLoadError(f"compressed-tensors format {sorted(map(str, formats))}: kvloom reads {', '.join(FORMATS)}")
    schemes = [(group.get("targets") or ["Linear"], WeightScheme.of(group)) for group in groups.values()]
    return CompressedCheckpoint(checkpoint, schemes, packed=formats == {"pack-quantized"})


class CompressedCheckpoint(Checkpoint):
    """The checkpoint with each quantized linear's `<name>.weight` de-quantized when read (for whatever runs it
    dense: tensor-parallel ranks, linears the GEMM cannot take), and its GGUF blocks for kvloom's quantized GEMM
    (`blocks`, as engine/model/quantized_weights.py's for a GGUF model)."""

    def __init__(self, checkpoint: Checkpoint, schemes: list[tuple[list[str], WeightScheme]], packed: bool) -> None:
        super().__init__(checkpoint.model_dir, checkpoint.files, checkpoint.dtype, checkpoint.device)
        self.packed = packed
        suffix = ".weight_packed" if packed else ".weight_scale"
        self.schemes: dict[str, WeightScheme] = {}  # by linear name: the quantized linears
        for prefix in (name.removesuffix(suffix) for name in checkpoint.files if name.endswith(suffix)):
            scheme = next((scheme for targets, scheme in schemes if _matches(prefix, targets)), None)
            if scheme is not None:
                self.schemes[prefix] = scheme
        self.int8_activations = any(s.int8_activations for s in self.schemes.values())
        self.dense_reasons: dict[str, str] = {}

    def _prefix(self, name: str) -> str | None:
        prefix = name.removesuffix(".weight")
        return prefix if prefix != name and prefix in self.schemes else None

    def __contains__(self, name: str) -> bool:
        return self._prefix(name) is not None or super().__contains__(name)

    def integers(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A linear's q [N, K] (int16), scales [N, K / g] and zero points [N, K / g] (or None), as stored."""
        scheme = self.schemes[prefix]

        def raw(suffix: str) -> torch.Tensor:
            return self._read(f"{prefix}.{suffix}", lambda f: f.get_tensor(f"{prefix}.{suffix}"))
        scale = raw("weight_scale")
        if scale.dim() == 1:
            scale = scale[:, None]
        if self.packed:
            rows, columns = raw("weight_shape").tolist()
            q = unpack(raw("weight_packed"), scheme.num_bits, columns)
        else:
            q = raw("weight").to(torch.int16)
        zero = None
        if not scheme.symmetric:
            zero = raw("weight_zero_point")
            if self.packed:  # packed along the outputs
                zero = unpack(zero.T.contiguous(), scheme.num_bits, q.shape[0]).T
            zero = zero.to(torch.int16).reshape(scale.shape)
        return q, scale, zero

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        prefix = self._prefix(name)
        if prefix is None:
            return super().get(name, dtype)
        q, scale, zero = self.integers(prefix)
        group = q.shape[1] // scale.shape[1]
        steps = (q - zero.repeat_interleave(group, 1) if zero is not None else q).double()
        weight = steps * scale.double().repeat_interleave(group, 1)  # s * (q - z), rounded once below
        return weight.to(device=self.device, dtype=dtype or self.dtype)

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._prefix(name) is None:
            return super().get_slice(name, dim, start, end, dtype)
        weight = self.get(name, dtype)
        return (weight[start:end] if dim == 0 else weight[:, start:end]).contiguous()

    def blocks(self, names: list[str]) -> tuple[torch.Tensor, QuantType] | None:
        """The weights `names` (side by side, as one linear computes them) as rows of GGUF blocks, if each is held
        exactly enough by one type (see above); else None, and it runs de-quantized."""
        converted = [self._blocks(name) for name in names]
        kinds = {c[1] if c else None for c in converted}
        if len(kinds) != 1 or None in kinds:
            return None
        rows = [c[0] for c in converted]
        return (torch.cat(rows) if len(rows) > 1 else rows[0]), kinds.pop()

    def _blocks(self, name: str) -> tuple[torch.Tensor, QuantType] | None:
        prefix = self._prefix(name)
        if prefix is None:
            return None
        scheme = self.schemes[prefix]
        qtype = scheme.qtype()
        q, scale, zero = self.integers(prefix)
        group = q.shape[1] // scale.shape[1]
        d = scale.to(torch.float16)
        if qtype is None:
            return self._dense(prefix, "8-bit with zero points")
        if group % BLOCK:
            return self._dense(prefix, f"groups of {group} inputs (not whole blocks of {BLOCK})")
        if not torch.equal(d.to(scale.dtype), scale):
            return self._dense(prefix, f"{scale.dtype} scales that float16 does not hold")
        per_group = group // BLOCK
        d = d.repeat_interleave(per_group, 1)
        q = q.view(q.shape[0], -1, BLOCK)
        if qtype is QuantType.Q8_0:
            return to_blocks(d, None, q.to(torch.int8), qtype), qtype
        m = None
        if zero is not None:  # d * (q + 8) + m = s * (q - z)
            m = (-scale.float() * (zero + 8)).repeat_interleave(per_group, 1).to(torch.float16)
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
            logger.info("quantization compressed-tensors: %s run de-quantized", "; ".join(
                f"{len(names)} linear(s) ({names[0]}, ...) for {reason}" for reason, names in by_reason.items()))
