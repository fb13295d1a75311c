"""A compressed-tensors checkpoint (what llm-compressor writes and vLLM runs: W4A16, W8A16, W8A8 in integers), read
without the compressed-tensors library; integer_weights.py runs it.

config.json's `quantization_config` (`quant_method: compressed-tensors`) says, per group of linears (`targets`), how
their weights are stored: integers of `num_bits`, a scale per output channel or per group of `group_size` inputs,
and where asymmetric an integer zero point. Format `pack-quantized` packs the integers into int32 words along the
input (weight i of each 32 at bit i * bits, as q + 2^(bits - 1); zero points likewise along the outputs),
`int-quantized` keeps int8. Input activations quantized to int8 (W8A8) run kvloom's int8 activations
(kernels/quantized_linear.py).
"""

import re

import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.model.integer_weights import IntegerCheckpoint, Integers, WeightScheme, input_groups, unpack

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def scheme_of(group: dict) -> WeightScheme:
    """A config group's scheme, if kvloom reads it."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8):
        raise ModelLoadError(f"compressed-tensors weights {weights}: kvloom runs 4- and 8-bit integers")
    if weights.get("strategy", "tensor") not in ("group", "channel"):
        raise ModelLoadError(f"compressed-tensors weight strategy {weights.get('strategy')!r}: kvloom runs group "
                             "and channel")
    int8_inputs = bool(inputs) and inputs.get("type", "int") == "int" and inputs.get("num_bits") == 8
    return WeightScheme(weights["num_bits"], weights.get("symmetric", True), int8_inputs)


def _match_rank(name: str, targets: list[str]) -> int | None:
    """How closely compressed-tensors' `targets` name a module, as the library ranks them: 0 the name itself, 1 a
    `re:` regex matched from the name's start, 2 the class `Linear` (every linear); None: not at all."""
    ranks = [0 if t == name else 1 if t.startswith("re:") and re.match(t[3:], name) else 2 if t == "Linear" else None
             for t in targets]
    return min((r for r in ranks if r is not None), default=None)


def _scheme_for(name: str, targeted: list[tuple[list[str], WeightScheme]]) -> WeightScheme:
    """The scheme of the group naming `name` most closely; a quantized module no group names is an error (its
    tensors cannot be read as anything else)."""
    ranked = [(rank, scheme) for targets, scheme in targeted if (rank := _match_rank(name, targets)) is not None]
    if not ranked:
        raise ModelLoadError(f"compressed-tensors: {name} is stored quantized but no config group targets it")
    return min(ranked, key=lambda pair: pair[0])[1]


def open_compressed(checkpoint: Checkpoint, config: dict) -> "CompressedCheckpoint":
    """`checkpoint` read through its `quantization_config` (compressed-tensors). Activation order `weight` (alias
    `static`) changed only GPTQ's calibration: its groups are consecutive. Older `group` order stored each input's group
    (`weight_g_idx`), read through it. What would read as wrong weights is refused: `group` order without its
    `weight_g_idx`, online rotations (`transform_config`), weights not yet compressed (`quantization_status`)."""
    groups = config.get("config_groups") or {}
    formats = {group.get("format") or config.get("format") for group in groups.values()}
    if not formats or not formats <= set(FORMATS):
        raise ModelLoadError(f"compressed-tensors format {sorted(map(str, formats))}: kvloom reads "
                             f"{', '.join(FORMATS)}")
    grouped = any((group.get("weights") or {}).get("actorder") not in (None, False, "weight", "static")
                  for group in groups.values())
    unmapped = grouped and not any(n.endswith(".weight_g_idx") for n in checkpoint.files)
    if unmapped or config.get("transform_config") or config.get("quantization_status", "compressed") != "compressed":
        raise ModelLoadError("compressed-tensors: kvloom reads compressed checkpoints without rotations whose groups "
                             "are consecutive or mapped by weight_g_idx (this one has activation-ordered groups "
                             "without it, a transform_config, or quantization_status "
                             f"{config.get('quantization_status')!r})")
    targeted = [(group.get("targets") or ["Linear"], scheme_of(group)) for group in groups.values()]
    prefixes = {name.rsplit(".", 1)[0] for name in checkpoint.files
                if name.endswith((".weight_packed", ".weight_scale"))}
    return CompressedCheckpoint(checkpoint, {prefix: _scheme_for(prefix, targeted) for prefix in sorted(prefixes)})


class CompressedCheckpoint(IntegerCheckpoint):
    method = "compressed-tensors"

    def integers(self, prefix: str) -> Integers:
        bits = self.schemes[prefix].num_bits
        scale = self.raw(f"{prefix}.weight_scale")
        scale = scale[:, None] if scale.dim() == 1 else scale
        packed = f"{prefix}.weight_packed" in self  # pack-quantized; else int-quantized: int8 as stored
        if packed:
            columns = int(self.raw(f"{prefix}.weight_shape")[1])
            q = unpack(self.raw(f"{prefix}.weight_packed"), bits, columns)
        else:
            q = self.raw(f"{prefix}.weight")
            if q.is_floating_point():
                raise ModelLoadError(f"compressed-tensors: {prefix}.weight is {q.dtype}, not the integers its "
                                     "scheme says")
            q = q.to(torch.int16)
        zero = None
        if not self.schemes[prefix].symmetric:
            zero = self.raw(f"{prefix}.weight_zero_point")
            if packed:  # packed along the outputs
                zero = unpack(zero.T.contiguous(), bits, q.shape[0]).T
            zero = zero.to(torch.int16).reshape(scale.shape)
        group_of = None
        if f"{prefix}.weight_g_idx" in self:
            group_of = input_groups(self.raw(f"{prefix}.weight_g_idx"), q.shape[1], scale.shape[1],
                                    q.shape[1] // scale.shape[1], f"compressed-tensors: {prefix}.weight_g_idx")
        return Integers(q, scale, zero, group_of)
