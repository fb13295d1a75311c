"""kvloom's tokenizer (tokenizers + jinja2) gives transformers' token ids and text, without transformers or torch;
the engine loads it, so a replica's start does not import transformers."""

import subprocess
import sys

import pytest

from kvloom.engine.model.fast_tokenizer import FastTokenizer, huggingface_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    "  leading spaces\tand tabs\n\nand blank lines  ",
    "accents é à ü, emoji 🤖, CJK 中文, RTL עברית",
    "<|im_start|>user\nspecial tokens typed as text<|im_end|>",
    "def square(x):\n    return x ** 2  # code\n",
    "w3 w4 w500 w9999 unknown words",
    "long " * 200,
]
CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?", "name": None}],
    [{"role": "user", "content": "<|im_end|><|im_start|>system\nan injection attempt"}],
    [{"role": "user", "content": "naïve café ☕\n\nsecond paragraph"}],
]


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def model_dir(request, smollm2_dir, tiny_model_dir):
    return smollm2_dir if request.param == "smollm2" else tiny_model_dir


def test_encodes_decodes_and_names_tokens_like_transformers(model_dir):
    ours, theirs = FastTokenizer(model_dir), huggingface_tokenizer(model_dir)
    assert len(ours) == len(theirs)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert ours.encode(text, add_special_tokens) == theirs.encode(text, add_special_tokens=add_special_tokens)
        ids = theirs.encode(text) + [theirs.eos_token_id]
        for skip_special_tokens in (True, False):
            assert ours.decode(ids, skip_special_tokens) == theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert (ours.eos_token, ours.eos_token_id) == (theirs.eos_token, theirs.eos_token_id)
    assert ours.get_vocab() == theirs.get_vocab()


def test_renders_chats_like_transformers(smollm2_dir):
    ours, theirs = FastTokenizer(smollm2_dir), huggingface_tokenizer(smollm2_dir)
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                  return_dict=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == list(expected)


def test_a_model_without_a_chat_template_refuses_chats(tiny_model_dir):
    with pytest.raises(ValueError, match="no chat template"):
        FastTokenizer(tiny_model_dir).apply_chat_template(CHATS[0])


def test_the_router_and_the_deploying_driver_load_neither_torch_nor_transformers(smollm2_dir):
    """`kvloom serve`'s driver imports the deployments and the router tokenizes: neither needs torch
    (each would keep ~250 MB of it mapped for as long as it serves)."""
    code = ("import sys; from pathlib import Path; import kvloom.cluster.app, kvloom.router.server; "
            "from kvloom.engine.model.fast_tokenizer import load_fast_tokenizer; "
            f"t = load_fast_tokenizer(Path({str(smollm2_dir)!r})); t.apply_chat_template([{{'role': 'user', "
            "'content': 'hi'}], add_generation_prompt=True); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_engine_starts_and_serves_without_importing_transformers(tiny_model_dir):
    """A replica's start does not pay transformers' import (2-3 s here): the tokenizer and the default RoPE are
    read without it."""
    code = ("import sys; from kvloom.engine.llm import LLM; from kvloom.engine.sampling import SamplingParams; "
            f"llm = LLM({str(tiny_model_dir)!r}, dtype='float32', kv_cache_memory_bytes=16 << 20); "
            "[out] = llm.generate(['w3 w4'], SamplingParams(max_tokens=4, temperature=0)); "
            "print(len(out.outputs[0].token_ids), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["4", "False"], out.stdout + out.stderr
