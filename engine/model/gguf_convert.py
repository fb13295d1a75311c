"""De-quantize a Llama-family GGUF file into a transformers-style safetensors directory, reading it once.

transformers can load a GGUF file too, but it parses the file's metadata three times (config, tokenizer,
weights), element by element, and builds a tensor-name map per tensor: about a minute for SmolLM2-135M on
a 2-core host against a few seconds here (docs/performance.md). The output is the same: bit-identical
weights, the same config and tokenizer files (tests/test_gguf_convert.py compares them).

Beside them, gguf-blocks.kvloom (a safetensors file under a name of its own: vLLM and others load every
*.safetensors file of a model directory as weights) keeps the linears whose block types kvloom runs as stored (Q4_0,
Q4_1, Q8_0: kernels/quantized_linear.py) as the file stores them, one uint8 row of blocks per output, and names
every 2-D weight's GGUF type in its metadata, for `quantization: gguf` (engine/model/quantized_weights.py).
"""

import json
from pathlib import Path

import numpy as np

from kvloom.engine.errors import ModelLoadError

# GGUF metadata key (after "<arch>.") -> config.json field, as llama.cpp's converter writes them
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}
TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                 "padding_token_id": "pad_token_id", "unknown_token_id": "unk_token_id"}
CONFIG_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name -> transformers name; "blk.N." becomes "model.layers.N."
TOP_LEVEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# llama.cpp interleaves the rotary halves of q and k rows for these architectures; undone on the way back
PERMUTED_ARCHITECTURES = {"llama", "mistral"}
QUANTIZED_FILE = "gguf-blocks.kvloom"  # safetensors inside (see above)
RUN_AS_STORED = {"Q4_0", "Q4_1", "Q8_0"}  # GGUF block types kvloom's quantized GEMM runs


def read_gguf(path: Path):
    """The file's metadata as plain Python values, and its tensors (still quantized)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    return metadata, reader.tensors


def hf_config(metadata: dict, tensor_names: set[str]) -> dict:
    """config.json's fields for the file's architecture."""
    arch = metadata.get("general.architecture")
    if arch not in CONFIG_CLASSES:
        raise ModelLoadError(f"GGUF architecture '{arch}' is not supported; kvloom runs {sorted(CONFIG_CLASSES)}")
    config = {"model_type": arch, "architectures": [CONFIG_CLASSES[arch]],
              "tie_word_embeddings": "output.weight" not in tensor_names}
    config |= {field: metadata[f"{arch}.{key}"] for key, field in CONFIG_KEYS.items() if f"{arch}.{key}" in metadata}
    config |= {field: metadata[f"tokenizer.ggml.{key}"] for key, field in TOKEN_ID_KEYS.items()
               if f"tokenizer.ggml.{key}" in metadata}
    config.setdefault("vocab_size", len(metadata["tokenizer.ggml.tokens"]))
    return config


def hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    if stem in TOP_LEVEL_TENSORS:
        return f"{TOP_LEVEL_TENSORS[stem]}.{kind}"
    block, layer, part = stem.split(".", 2) if stem.startswith("blk.") else ("", "", stem)
    if not block or part not in LAYER_TENSORS:
        raise ModelLoadError(f"GGUF tensor '{gguf_name}' has no place in a Llama-family model")
    return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the rotary halves (rows)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_rows(tensor, rows: np.ndarray, config: dict) -> np.ndarray:
    """A tensor's rows (values, or a quantized type's rows of blocks) in transformers' order."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    part = tensor.name.split(".")[-2]
    if config["model_type"] in PERMUTED_ARCHITECTURES and part in heads:
        return unpermute_rotary(rows, heads[part])
    return rows


def hf_tensors(tensors, config: dict) -> dict:
    """De-quantized float32 torch tensors under transformers' names, in transformers' (row-major) shapes."""
    import torch
    from gguf import dequantize

    out = {}
    for tensor in tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest-moving dimension first
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)  # a writable copy
        out[hf_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(hf_rows(tensor, weight, config)))
    return out


def write_quantized(gguf: Path, target: Path) -> None:
    """`target`'s QUANTIZED_FILE from the GGUF file (written whole or not at all)."""
    import torch
    from safetensors.torch import save_file

    metadata, tensors = read_gguf(gguf)
    config = hf_config(metadata, {t.name for t in tensors})
    types, kept = {}, {}
    for tensor in tensors:
        if len(tensor.shape) != 2:
            continue
        name, kind = hf_name(tensor.name), tensor.tensor_type.name
        types[name] = kind
        if kind in RUN_AS_STORED:
            kept[name] = torch.from_numpy(np.ascontiguousarray(hf_rows(tensor, np.array(tensor.data), config)))
    staging = target / f".{QUANTIZED_FILE}.tmp"
    save_file(kept, staging, metadata={"gguf_types": json.dumps(types)})
    staging.replace(target / QUANTIZED_FILE)


def convert_gguf(gguf: Path, target: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer's files into `target`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

    metadata, tensors = read_gguf(gguf)
    fields = hf_config(metadata, {t.name for t in tensors})
    config = AutoConfig.for_model(**{**fields, "dtype": "float32"})
    config.save_pretrained(target)
    GenerationConfig.from_model_config(config).save_pretrained(target)
    save_file(hf_tensors(tensors, fields), target / "model.safetensors", metadata={"format": "pt"})
    PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)
    write_quantized(gguf, target)
