"""Llama-shaped checkpoints with random weights, made where they run: an 8B shape built on the device (no hub, no
16 GB file to carry), and a folder's missing weights written from its config.json (a tokenizer and a config
travel; the weights of SmolLM2, 98 MB even quantized, exceed what a device check may carry)."""

import json
from pathlib import Path

import torch

from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.model.model_config import ModelConfig
from kvloom.kernels.gguf_blocks import QuantType

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
            "bos_token_id": 1, "eos_token_id": 2}


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-family checkpoint by its safetensors name."""
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.self_attn.q_proj.weight": (heads * d, h), f"{p}.self_attn.k_proj.weight": (kv * d, h),
                   f"{p}.self_attn.v_proj.weight": (kv * d, h), f"{p}.self_attn.o_proj.weight": (h, heads * d),
                   f"{p}.mlp.gate_proj.weight": (config.intermediate_size, h),
                   f"{p}.mlp.up_proj.weight": (config.intermediate_size, h),
                   f"{p}.mlp.down_proj.weight": (h, config.intermediate_size),
                   f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device):
    """Norm weights 1, the rest N(0, 0.02), drawn on `device` (the same tensor for the same name, seed and
    device kind)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name))
    return (torch.randn(shape, generator=generator, device=device) * 0.02).to(dtype)


class RandomCheckpoint(Checkpoint):
    """A Checkpoint whose tensors are made on request, on the checkpoint's device, never read from a file."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        super().__init__(config.model_dir, {}, dtype, device)
        self.shapes, self.seed = tensor_shapes(config), seed

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return random_tensor(name, self.shapes[name], self.seed, dtype or self.dtype, self.device)


def write_config(path: Path, shape: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **shape}))
    return path


def fill_missing_weights(model_dir: Path, seed: int = 0) -> Path:
    """Write `model.safetensors` with random float32 weights where a folder has a config but no weights."""
    from safetensors.torch import save_file

    if not (model_dir / "model.safetensors").is_file():
        config = ModelConfig.from_dir(model_dir)
        cpu = torch.device("cpu")
        save_file({name: random_tensor(name, shape, seed, torch.float32, cpu)
                   for name, shape in tensor_shapes(config).items()}, model_dir / "model.safetensors")
    return model_dir


PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, config: ModelConfig, rank: int, seed: int = 0,
                         targets: tuple[str, ...] = PEFT_TARGETS, alpha: float | None = None,
                         scale: float = 0.05) -> Path:
    """A LoRA adapter in PEFT's format with random A and B (PEFT starts B at zero: the adapter would change nothing),
    large enough to change a random model's greedy tokens, for tests and the LoRA benchmark (no hub)."""
    from safetensors.torch import save_file

    from kvloom.engine.lora.adapter import CONFIG_FILE, FUSED_PARTS, WEIGHTS_FILE, part_features

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part in (p for parts in FUSED_PARTS.values() for p in parts if p.split(".")[1] in targets):
            features_in, features_out = part_features(config, part)
            prefix = f"base_model.model.model.layers.{layer}.{part}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
                "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
                "base_model_name_or_path": str(config.model_dir)}
    (path / CONFIG_FILE).write_text(json.dumps(settings, indent=2))
    return path


def random_gguf_blocks(outputs: int, inputs: int, qtype: QuantType, generator: torch.Generator) -> torch.Tensor:
    """A weight [outputs, inputs] as GGUF blocks [outputs, inputs/32 * block bytes] uint8: random quants, scales
    (and Q4_1 mins) about 0.01. Any bytes with finite scales are a valid block, so no quantizer is needed."""
    blocks = inputs // 32
    scale = lambda: ((torch.rand(outputs, blocks, 1, generator=generator) + 0.1) * 0.01  # noqa: E731
                     ).half().view(torch.uint8)
    quants = torch.randint(0, 256, (outputs, blocks, 32 if qtype is QuantType.Q8_0 else 16), generator=generator,
                           dtype=torch.uint8)
    header = [scale(), (-scale().view(torch.float16)).view(torch.uint8)] if qtype is QuantType.Q4_1 else [scale()]
    return torch.cat([*header, quants], dim=-1).reshape(outputs, -1)
