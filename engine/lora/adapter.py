"""A LoRA adapter in PEFT's format, read and checked against the base model, laid out for kvloom's fused linears.

PEFT saves `adapter_config.json` (rank r, lora_alpha, target_modules, ...) and `adapter_model.safetensors` holding,
for each patched linear, lora_A [r, in] and lora_B [out, r]: the linear computes W x + scaling * B A x. kvloom's
decoder runs q|k|v as one linear and gate|up as another (engine/model/decoder.py), so each fused linear gets one
pair: `a` [R, in] stacking the targeted parts' A (R their ranks summed), and `b` [R, out] placing each part's B,
scaling folded in, over that part's output columns and zero elsewhere (`parts` says where the nonzero blocks are,
and the kernels read those only). A fused linear then costs one shrink per adapter, and one expand per part.
"""

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.lora.identity import CONFIG_FILE, WEIGHTS_FILE, cache_root
from kvloom.engine.model.model_config import ModelConfig

# each fused linear of the decoder -> its parts in output order, named as PEFT names them
FUSED_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
                  r"\.lora_([AB])\.weight")


@dataclass(frozen=True)
class AdapterRef:
    """What a request carries: enough to find its adapter's weights again (engine/lora/registry.py)."""
    name: str
    path: Path
    cache_root: int  # see LoRAAdapter.cache_root


@dataclass
class LoRAPair:
    a: torch.Tensor  # [R, in]: the shrink (as PEFT stores lora_A: each rank's row contiguous)
    b: torch.Tensor  # [R, out]: the expand, scaling folded in
    parts: tuple[tuple[int, int, int, int], ...]  # per targeted part: its rows r0..r1 of b, nonzero over c0..c1

    @functools.cached_property
    def expand(self) -> torch.Tensor:
        """b as the C++ op reads it (packed once, on the first step that needs it: kernels/cpu_lora.py)."""
        from kvloom.kernels.cpu_lora import pack_expand

        return pack_expand(self.b, self.parts)


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    cache_root: int  # its prompts' block-hash root (engine/lora/identity.py)
    layers: list[dict[str, LoRAPair]]  # per decoder layer: fused linear name -> its pair (absent: not patched)

    @functools.cached_property
    def weights_table(self) -> torch.Tensor:
        """Every layer's fused linears' weights, as the C++ op finds them (kernels/cpu_lora.py), row
        `layer * len(FUSED_PARTS) + linear`: built once, on the first CPU step that reads the adapter. It holds
        addresses of the pairs' `a` and `expand`, which this adapter holds as long as it is."""
        from kvloom.kernels.cpu_lora import weights_table

        pairs = [layer.get(linear) for layer in self.layers for linear in FUSED_PARTS]
        return weights_table([(pair.a, pair.expand, pair.parts) if pair is not None else None for pair in pairs])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for p in layer.values() for t in (p.a, p.b))


def part_features(config: ModelConfig, part: str) -> tuple[int, int]:
    """(in, out) features of one of the model's linears, by its PEFT name."""
    attention, kv, mlp = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                          config.intermediate_size)
    hidden = config.hidden_size
    return {"self_attn.q_proj": (hidden, attention), "self_attn.k_proj": (hidden, kv),
            "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (attention, hidden),
            "mlp.gate_proj": (hidden, mlp), "mlp.up_proj": (hidden, mlp), "mlp.down_proj": (mlp, hidden)}[part]


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for this base model; every refusal is an `InvalidRequestError` naming
    `lora_path` and what is wrong, so a bad adapter is a 400, never a crashed replica."""
    path = Path(path)
    settings = _read_config(path)
    try:
        raw = (path / WEIGHTS_FILE).read_bytes()
        tensors = load_safetensors(raw)
    except (OSError, SafetensorError) as exc:
        raise InvalidRequestError("lora_path", f"cannot read {path / WEIGHTS_FILE}: {exc}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise InvalidRequestError("lora_path", f"{path.name} holds {key}: kvloom patches the attention and MLP "
                                                   "projections of the decoder layers only")
        layer, part, which = int(match[1]), match[2], match[3]
        if layer >= config.num_hidden_layers:
            raise InvalidRequestError("lora_path", f"{key}: the base model has {config.num_hidden_layers} layers")
        parts.setdefault((layer, part), {})[which] = tensor
    layers: list[dict[str, LoRAPair]] = [{} for _ in range(config.num_hidden_layers)]
    for fused, names in FUSED_PARTS.items():
        for layer in range(config.num_hidden_layers):
            found = [(part, parts[(layer, part)]) for part in names if (layer, part) in parts]
            if found:
                layers[layer][fused] = _fuse(config, settings, layer, names, found, max_rank, dtype)
    if not any(layers):
        raise InvalidRequestError("lora_path", f"{path / WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(name, path, cache_root(name, raw), layers)


def _read_config(path: Path) -> dict:
    try:
        settings = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError("lora_path", f"cannot read {path / CONFIG_FILE}: {exc}") from None
    refusals = {
        "peft_type": (settings.get("peft_type", "LORA") != "LORA", "is not LORA"),
        "use_dora": (bool(settings.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (settings.get("bias", "none") != "none", "trained biases are not supported (bias must be none)"),
        "modules_to_save": (bool(settings.get("modules_to_save")), "fully trained modules are not supported"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise InvalidRequestError("lora_path", f"{path / CONFIG_FILE}: {key}: {why}")
    if not isinstance(settings.get("r"), int) or settings["r"] < 1:
        raise InvalidRequestError("lora_path", f"{path / CONFIG_FILE}: r must be a positive integer")
    return settings


def _pattern_value(settings: dict, pattern_key: str, default, module: str):
    """PEFT's per-module override (rank_pattern, alpha_pattern): a key matching the module name's tail."""
    for pattern, value in (settings.get(pattern_key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _fuse(config: ModelConfig, settings: dict, layer: int, names: tuple[str, ...],
          found: list[tuple[str, dict[str, torch.Tensor]]], max_rank: int, dtype: torch.dtype) -> LoRAPair:
    """One fused linear's pair from its targeted parts' A and B (see the module docstring)."""
    columns, start = {}, 0
    for part in names:
        columns[part] = start
        start += part_features(config, part)[1]
    shrinks, expands, layout, rows = [], [], [], 0
    for part, weights in found:
        module = f"model.layers.{layer}.{part}"
        if missing := {"A", "B"} - set(weights):
            raise InvalidRequestError("lora_path", f"{module} has no lora_{missing.pop()}")
        a, b = weights["A"], weights["B"]
        features_in, features_out = part_features(config, part)
        r = a.shape[0]
        if a.shape != (r, features_in) or b.shape != (features_out, r):
            raise InvalidRequestError("lora_path", f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                                                   f"not fit the base model's {features_out}x{features_in} linear")
        if r > max_rank:
            raise InvalidRequestError("lora_path", f"{module} has rank {r}; max_lora_rank is {max_rank}")
        alpha = _pattern_value(settings, "alpha_pattern", settings.get("lora_alpha", 8), module)
        scaling = alpha / (r ** 0.5 if settings.get("use_rslora") else r)
        expand = torch.zeros(r, start, dtype=torch.float32)
        expand[:, columns[part] : columns[part] + features_out] = b.float().t() * scaling
        shrinks.append(a.float())
        expands.append(expand)
        layout.append((rows, rows + r, columns[part], columns[part] + features_out))
        rows += r
    return LoRAPair(torch.cat(shrinks).to(dtype).contiguous(), torch.cat(expands).to(dtype).contiguous(),
                    tuple(layout))
