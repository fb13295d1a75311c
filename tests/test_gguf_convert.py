"""kvloom's GGUF conversion gives what transformers' GGUF loader gives: the same weights bit for bit (llama.cpp's
interleaved q/k rows undone for Llama, left alone for Qwen2), the same config and the same tokenizer. Checked on
tiny GGUF files written here the way llama.cpp's converter writes them, so transformers' slow loader stays cheap."""

import numpy as np
import pytest
import torch

from kvloom.engine.errors import ModelLoadError
from kvloom.benchmarks.tiny_model import write_tiny_gguf
from kvloom.engine.model.gguf_convert import convert_gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_converted_gguf_equals_what_transformers_loads_from_it(tmp_path, arch):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = tmp_path / "tiny.gguf"
    originals = write_tiny_gguf(gguf, arch)
    convert_gguf(gguf, tmp_path / "converted")
    ours = load_file(tmp_path / "converted" / "model.safetensors")
    # the only *.safetensors file: vLLM and others load every one as weights (the blocks file has its own name)
    assert [p.name for p in (tmp_path / "converted").glob("*.safetensors")] == ["model.safetensors"]
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
