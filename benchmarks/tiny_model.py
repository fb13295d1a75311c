"""A tiny random Llama-family checkpoint, built on the fly: for tests, and for benchmarks of the serving path
whose engine steps must cost next to nothing."""

from pathlib import Path

import numpy as np


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def build_tiny_llama(path: Path, seed: int = 0, model_type: str = "llama", tied: bool = False,
                     chat: bool = False, context: int = 1024) -> Path:
    """A 2-layer random Llama-family model (llama, qwen2, qwen3) with grouped-query attention and a
    word-level tokenizer (`w3` .. `w511`); `tied`: the LM head shares the embedding table (like SmolLM2);
    `chat`: the tokenizer has a chat template (CHAT_TEMPLATE), so the chat endpoints serve it; `context`: its
    max_position_embeddings."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=context,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2  # write_tiny_gguf's shapes


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, the base of a byte-level BPE vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q and k rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(path, arch: str, down_type: str = "Q8_0") -> dict[str, np.ndarray]:
    """A two-layer model of `arch` (llama or qwen2) as llama.cpp's converter writes one, with a byte-level BPE
    vocabulary and Q8_0 / Q4_1 weights (the MLP's down projections in `down_type`); returns its float weights
    (before quantization) under HF names."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    alphabet = byte_level_alphabet()
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = ["<|endoftext|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe"]
    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    generator = np.random.default_rng(0)
    hf = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype=GGMLQuantizationType.Q8_0, stored=None):
        weight = generator.standard_normal(shape).astype(np.float32)
        hf[hf_name] = weight
        on_file = weight if stored is None else stored(weight)
        if len(shape) == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, on_file)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, on_file.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(on_file, qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), HIDDEN))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    add("output.weight", "lm_head.weight", (len(tokens), HIDDEN), GGMLQuantizationType.Q4_1)
    permute = arch == "llama"
    for layer in range(LAYERS):
        blk, hf_layer = f"blk.{layer}", f"model.layers.{layer}"
        add(f"{blk}.attn_norm.weight", f"{hf_layer}.input_layernorm.weight", (HIDDEN,))
        add(f"{blk}.ffn_norm.weight", f"{hf_layer}.post_attention_layernorm.weight", (HIDDEN,))
        for part, proj, rows, heads in (("q", "q_proj", HIDDEN, HEADS), ("k", "k_proj", HIDDEN // 2, KV_HEADS)):
            add(f"{blk}.attn_{part}.weight", f"{hf_layer}.self_attn.{proj}.weight", (rows, HIDDEN),
                stored=(lambda w, h=heads: interleave_rotary(w, h)) if permute else None)
        add(f"{blk}.attn_v.weight", f"{hf_layer}.self_attn.v_proj.weight", (HIDDEN // 2, HIDDEN))
        add(f"{blk}.attn_output.weight", f"{hf_layer}.self_attn.o_proj.weight", (HIDDEN, HIDDEN))
        if arch == "qwen2":
            for part, rows in (("q", HIDDEN), ("k", HIDDEN // 2), ("v", HIDDEN // 2)):
                add(f"{blk}.attn_{part}.bias", f"{hf_layer}.self_attn.{part}_proj.bias", (rows,))
        add(f"{blk}.ffn_gate.weight", f"{hf_layer}.mlp.gate_proj.weight", (FFN, HIDDEN), GGMLQuantizationType.Q4_1)
        add(f"{blk}.ffn_up.weight", f"{hf_layer}.mlp.up_proj.weight", (FFN, HIDDEN), GGMLQuantizationType.Q4_1)
        add(f"{blk}.ffn_down.weight", f"{hf_layer}.mlp.down_proj.weight", (HIDDEN, FFN),
            GGMLQuantizationType[down_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
