"""What the engine needs to know about a model, read from its config.json without transformers' model classes.

transformers 5's per-architecture config classes (`LlamaConfig`, ...) import its whole modeling stack on
the way (activations -> hub kernels -> continuous batching -> torch._dynamo, sympy, torch.distributed):
about 180 MB of resident memory and 3 s per process, for a forward kvloom runs itself. This reads the
same JSON, fills in the defaults those classes would (grouped-query heads, head_dim), and hands
transformers the generic `PreTrainedConfig` only where one is needed (tokenizer class, RoPE tables).
"""

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from kvloom.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}


def _token_ids(value) -> set[int]:
    if isinstance(value, int):
        return {value}
    return set(value or ())


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    eos_token_ids: frozenset[int]  # generation_config.json's, else config.json's
    raw: dict = field(repr=False, compare=False)  # config.json as read

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        raw = _read_json(model_dir / "config.json")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture '{model_type}' in {model_dir}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        generation = model_dir / "generation_config.json"
        eos = _read_json(generation).get("eos_token_id") if generation.is_file() else None
        try:
            heads = raw["num_attention_heads"]
            return cls(
                model_dir=model_dir, model_type=model_type, hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                num_hidden_layers=raw["num_hidden_layers"], vocab_size=raw["vocab_size"],
                max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                hidden_act=raw.get("hidden_act", "silu"), tie_word_embeddings=raw.get("tie_word_embeddings", False),
                eos_token_ids=frozenset(_token_ids(eos if eos is not None else raw.get("eos_token_id"))), raw=raw,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{model_dir / 'config.json'} has no {exc.args[0]}") from None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_key_value_heads * self.head_dim * torch.finfo(dtype).bits // 8 * self.num_hidden_layers

    @cached_property
    def rope_parameters(self) -> dict:
        """RoPE's settings as transformers 5 writes them (`rope_parameters` in config.json, read without importing
        transformers); a config in the older form (`rope_theta`, `rope_scaling`) is read by transformers."""
        params = self.raw.get("rope_parameters")
        return dict(params) if isinstance(params, dict) else dict(self.transformers_config.rope_parameters or {})

    @cached_property
    def transformers_config(self):
        """transformers' generic config over the same JSON (no model class imported)."""
        from transformers import PreTrainedConfig

        return PreTrainedConfig.from_dict(self.raw)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
