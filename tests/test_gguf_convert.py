"""kvloom's GGUF conversion gives what transformers' GGUF loader gives: the same weights bit for bit (llama.cpp's
interleaved q/k rows undone for Llama, left alone for Qwen2), the same config and the same tokenizer. Checked on
tiny GGUF files written here the way llama.cpp's converter writes them, so transformers' slow loader stays cheap."""

import numpy as np
import pytest
import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.engine.model.gguf_convert import convert_gguf

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, the base of a byte-level BPE vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q and k rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(path, arch: str) -> dict[str, np.ndarray]:
    """A two-layer model of `arch` with a byte-level BPE vocabulary; returns its float weights under HF names."""
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
        add(f"{blk}.ffn_up.weight", f"{hf_layer}.mlp.up_proj.weight", (FFN, HIDDEN))
        add(f"{blk}.ffn_down.weight", f"{hf_layer}.mlp.down_proj.weight", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_converted_gguf_equals_what_transformers_loads_from_it(tmp_path, arch):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = tmp_path / "tiny.gguf"
    originals = write_tiny_gguf(gguf, arch)
    convert_gguf(gguf, tmp_path / "converted")
    ours = load_file(tmp_path / "converted" / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    theirs = model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    q_proj = ours["model.layers.0.self_attn.q_proj.weight"].numpy()  # Q8_0 keeps about two decimal digits
    assert np.allclose(q_proj, originals["model.layers.0.self_attn.q_proj.weight"], atol=0.05)

    our_config = AutoConfig.from_pretrained(tmp_path / "converted").to_dict()
    their_config = AutoConfig.from_pretrained(tmp_path, gguf_file=gguf.name).to_dict()
    saved_by_a_model = {"architectures", "dtype"}  # transformers writes these when it saves the loaded model
    assert {k: v for k, v in our_config.items() if not k.startswith("_") and k not in saved_by_a_model} == {
        k: v for k, v in their_config.items() if not k.startswith("_") and k not in saved_by_a_model}
    assert our_config["dtype"] == "float32" and our_config["architectures"] == [type(model).__name__]

    text = "the theory of the thing"
    our_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "converted")
    their_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    assert our_tokenizer.encode(text) == their_tokenizer.encode(text)
    assert our_tokenizer.eos_token == their_tokenizer.eos_token == "<|im_end|>"


def test_an_architecture_kvloom_cannot_run_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    gguf = tmp_path / "phi.gguf"
    writer = GGUFWriter(gguf, "phi2")
    writer.add_token_list(["a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'phi2' is not supported"):
        convert_gguf(gguf, tmp_path / "converted")


def test_the_same_gguf_in_another_place_reuses_its_converted_copy(tmp_path, monkeypatch):
    """A model file installed in a second environment (another path, another mtime) is not converted again."""
    import shutil

    from kvloom.engine.model import model_files

    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    first = tmp_path / "one" / "tiny.gguf"
    first.parent.mkdir()
    write_tiny_gguf(first, "llama")
    converted = model_files.resolve_model_dir(str(first))
    second = tmp_path / "two" / "tiny.gguf"
    second.parent.mkdir()
    shutil.copy(first, second)  # a new mtime
    monkeypatch.setattr(model_files, "_convert_gguf", lambda *args: pytest.fail("converted again"))
    assert model_files.resolve_model_dir(str(second)) == converted
    data = bytearray(second.read_bytes())
    data[-1] ^= 1  # one bit of the last weights changed: another model
    second.write_bytes(bytes(data))
    assert model_files._fingerprint(second) != model_files._fingerprint(first)
