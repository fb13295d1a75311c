"""A LoRA adapter in PEFT's format, read and checked against the base model, laid out for kvloom's fused linears.

PEFT saves `adapter_config.json` (rank r, lora_alpha, target_modules, ...) and `adapter_model.safetensors` holding,
for each patched linear, lora_A [r, in] and lora_B [out, r]: the linear computes W x + scaling * B A x. kvloom's
decoder runs q|k|v as one linear and gate|up as another (engine/model/decoder.py), so each fused linear gets one
pair: `a` [R, in] stacking the targeted parts' A (R their ranks summed), and `b` [R, out] placing each part's B,
scaling folded in, over that part's output columns and zero elsewhere (`parts` says where the nonzero blocks are,
and the kernels read those only). A fused linear then costs one shrink per adapter, and one expand per part.

An adapter is checked from its config and its weights file's header alone (`inspect_adapter`: every refusal, no
weights read), so an engine checks its configured adapters at start cheaply, and reads one when a request needs it.
Reading lays the weights out for the kernels that will run them: each `b` as the C++ op reads it and the adapter's
table of them (kernels/cpu_lora.py) where CPU steps run it, so a step never waits on a layout.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.lora.identity import CONFIG_FILE, WEIGHTS_FILE, cache_root, weights_digest
from kvloom.engine.model.model_config import ModelConfig
from kvloom.kernels.cpu_lora import pack_expand, weights_table

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


@dataclass(frozen=True)
class PartLayout:
    """Where one targeted linear's A and B go in its fused linear's pair, by their keys in the weights file."""
    a_key: str
    b_key: str
    bounds: tuple[int, int, int, int]  # rows r0..r1 of the pair, its output columns c0..c1
    scaling: float


@dataclass
class LoRAPair:
    a: torch.Tensor  # [R, in]: the shrink (as PEFT stores lora_A: each rank's row contiguous)
    b: torch.Tensor  # the expand, scaling folded in: [R, out], or as the C++ op reads it (kernels/cpu_lora.py)
    parts: tuple[tuple[int, int, int, int], ...]  # per targeted part: its rows r0..r1 of b, nonzero over c0..c1


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    cache_root: int  # its prompts' block-hash root (engine/lora/identity.py)
    layers: list[dict[str, LoRAPair]]  # per decoder layer: fused linear name -> its pair (absent: not patched)
    # laid out for the C++ op: every layer's fused linears' weights, row `layer * len(FUSED_PARTS) + linear`; it holds
    # addresses of the pairs' tensors, which this adapter holds as long as it is
    table: torch.Tensor | None = None

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


def inspect_adapter(path: Path, config: ModelConfig, max_rank: int) -> dict[tuple[int, str], list[PartLayout]]:
    """Check a PEFT LoRA adapter against this base model from its config and its weights' header, and lay its
    parts out: (layer, fused linear) -> its parts. Every refusal is an `InvalidRequestError` naming `lora_path` and
    what is wrong, so a bad adapter is a 400, never a crashed replica."""
    settings = _read_config(path)
    try:
        with safe_open(path / WEIGHTS_FILE, framework="pt") as weights:
            shapes = {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}
    except (OSError, SafetensorError) as exc:
        raise InvalidRequestError("lora_path", f"cannot read {path / WEIGHTS_FILE}: {exc}") from None
    keys: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        match = _KEY.fullmatch(key)
        if match is None:
            raise InvalidRequestError("lora_path", f"{path.name} holds {key}: kvloom patches the attention and MLP "
                                                   "projections of the decoder layers only")
        layer, part, which = int(match[1]), match[2], match[3]
        if layer >= config.num_hidden_layers:
            raise InvalidRequestError("lora_path", f"{key}: the base model has {config.num_hidden_layers} layers")
        keys.setdefault((layer, part), {})[which] = key
    layouts = {}
    for fused, names in FUSED_PARTS.items():
        for layer in range(config.num_hidden_layers):
            if found := [(part, keys[(layer, part)]) for part in names if (layer, part) in keys]:
                layouts[(layer, fused)] = _lay_out(config, settings, shapes, layer, names, found, max_rank)
    if not layouts:
        raise InvalidRequestError("lora_path", f"{path / WEIGHTS_FILE} holds no LoRA weights")
    return layouts


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype,
                 for_cpu_op: bool = False) -> LoRAAdapter:
    """Check and read an adapter (`inspect_adapter`), its weights in `dtype`; `for_cpu_op`: laid out for the C++ op
    (each b packed, and the adapter's table). The weights file is hashed for its cache root on another thread
    while its tensors are read and laid out."""
    path = Path(path)
    layouts = inspect_adapter(path, config, max_rank)
    with ThreadPoolExecutor(1) as hasher:
        digest = hasher.submit(weights_digest, path / WEIGHTS_FILE)
        try:
            tensors = load_file(path / WEIGHTS_FILE)
        except (OSError, SafetensorError) as exc:
            raise InvalidRequestError("lora_path", f"cannot read {path / WEIGHTS_FILE}: {exc}") from None
        layers: list[dict[str, LoRAPair]] = [{} for _ in range(config.num_hidden_layers)]
        for (layer, fused), parts in layouts.items():
            try:
                pair = _fuse(config, fused, parts, tensors, dtype)
            except (KeyError, RuntimeError) as exc:  # the file, checked from its header a moment ago, was replaced
                raise InvalidRequestError("lora_path", f"{path / WEIGHTS_FILE} changed while it was read: "
                                                       f"{exc}") from None
            layers[layer][fused] = LoRAPair(pair.a, pack_expand(pair.b, pair.parts), pair.parts) if for_cpu_op else pair
        table = None
        if for_cpu_op:
            pairs = [layer.get(linear) for layer in layers for linear in FUSED_PARTS]
            table = weights_table([(pair.a, pair.b, pair.parts) if pair is not None else None for pair in pairs])
        return LoRAAdapter(name, path, cache_root(name, digest.result()), layers, table)


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


def _lay_out(config: ModelConfig, settings: dict, shapes: dict[str, tuple[int, ...]], layer: int,
             names: tuple[str, ...], found: list[tuple[str, dict[str, str]]], max_rank: int) -> list[PartLayout]:
    """One fused linear's targeted parts, checked, in the pair's rows and columns (see the module docstring)."""
    columns, start = {}, 0
    for part in names:
        columns[part] = start
        start += part_features(config, part)[1]
    layouts, rows = [], 0
    for part, keys in found:
        module = f"model.layers.{layer}.{part}"
        if missing := {"A", "B"} - set(keys):
            raise InvalidRequestError("lora_path", f"{module} has no lora_{missing.pop()}")
        a, b = shapes[keys["A"]], shapes[keys["B"]]
        features_in, features_out = part_features(config, part)
        r = a[0] if len(a) == 2 else 0
        if a != (r, features_in) or b != (features_out, r):
            raise InvalidRequestError("lora_path", f"{module}: lora_A {a} and lora_B {b} do not fit the base model's "
                                                   f"{features_out}x{features_in} linear")
        if r > max_rank:
            raise InvalidRequestError("lora_path", f"{module} has rank {r}; max_lora_rank is {max_rank}")
        alpha = _pattern_value(settings, "alpha_pattern", settings.get("lora_alpha", 8), module)
        scaling = alpha / (r ** 0.5 if settings.get("use_rslora") else r)
        layouts.append(PartLayout(keys["A"], keys["B"], (rows, rows + r, columns[part], columns[part] + features_out),
                                  scaling))
        rows += r
    return layouts


def _fuse(config: ModelConfig, fused: str, parts: list[PartLayout], tensors: dict[str, torch.Tensor],
          dtype: torch.dtype) -> LoRAPair:
    """One fused linear's pair in `dtype`, written in place (each B scaled in float32, then rounded once)."""
    rank = parts[-1].bounds[1]
    features_in = part_features(config, FUSED_PARTS[fused][0])[0]
    features_out = sum(part_features(config, part)[1] for part in FUSED_PARTS[fused])
    a = torch.empty(rank, features_in, dtype=dtype)
    b = torch.zeros(rank, features_out, dtype=dtype)
    for part in parts:
        r0, r1, c0, c1 = part.bounds
        a[r0:r1].copy_(tensors[part.a_key])
        b[r0:r1, c0:c1].copy_(tensors[part.b_key].float().t() * part.scaling)
    return LoRAPair(a, b, tuple(part.bounds for part in parts))
