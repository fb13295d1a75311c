"""Rotary position embedding tables for the fused decoder, computed as transformers computes them.

The default RoPE is computed here; scaled variants (linear, llama3, yarn) take their inverse frequencies from
transformers' own RoPE functions (`modeling_rope_utils`, which does not import the model classes), so they
match the stock forward exactly.
Variants whose frequencies change with the sequence length (dynamic NTK, LongRoPE) are not covered.
"""

from dataclasses import dataclass

import torch

from kvloom.engine.model.model_config import ModelConfig

LENGTH_DEPENDENT_TYPES = {"dynamic", "longrope"}


def unsupported_rope(config: ModelConfig) -> str | None:
    """Why the fused decoder cannot run this model's RoPE, or None if it can."""
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_TYPES:
        return f"RoPE type '{rope_type}' (its frequencies depend on the sequence length)"
    if "rope_theta" not in params:
        return "no rope_theta in config.json"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    return None


@dataclass(frozen=True)
class RotaryEmbedding:
    inv_freq: torch.Tensor  # [head_dim / 2], float32
    attention_scaling: float

    @classmethod
    def of(cls, config: ModelConfig, device: torch.device) -> "RotaryEmbedding":
        params = config.rope_parameters
        if params.get("rope_type", "default") == "default":
            dim = config.head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config.transformers_config, device)
        return cls(inv_freq.to(device=device, dtype=torch.float), float(scaling))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, float32 [T, head_dim] each (both halves repeated), for positions [T]."""
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
