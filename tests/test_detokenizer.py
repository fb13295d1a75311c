"""Detokenization reads the tokenizer's Rust backend directly, and says exactly what transformers' `decode` says."""

import random

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from kvloom.engine.detokenizer import IncrementalDetokenizer, token_decoder
from kvloom.engine.model.model_loader import load_tokenizer


def test_smollm2_ids_decode_as_transformers_decodes_them(smollm2_dir):
    """Single tokens (multi-byte pieces among them), special tokens, and random runs of ids."""
    tokenizer = load_tokenizer(smollm2_dir)
    decode = token_decoder(tokenizer)
    rng = random.Random(0)
    cases = [[i] for i in range(0, 49152, 97)] + [[rng.randrange(49152) for _ in range(rng.randrange(1, 12))]
                                                   for _ in range(500)]
    cases += [[1, 2, 504, 3458], tokenizer.encode("naïve café — 東京 🙂 done")]
    assert [decode(ids) for ids in cases] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in cases]


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    backend = Tokenizer(WordLevel({"<unk>": 0, "hello": 1, ",": 2, "world": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=True)
    cleaned = tokenizer.decode([1, 2, 3], skip_special_tokens=True)
    assert token_decoder(tokenizer)([1, 2, 3]) == cleaned == "hello, world"


def test_streamed_text_adds_up_to_the_whole_decode(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    prompt = tokenizer.encode("A list:")
    output = tokenizer.encode(" naïve café, 東京 🙂 and more\n\n- done")
    detok = IncrementalDetokenizer(token_decoder(tokenizer), prompt, stop=[])
    pieces = []
    for token in output:
        detok.add_token(token)
        pieces.append(detok.release(finished=False))
    pieces.append(detok.release(finished=True))
    assert "".join(pieces) == tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]
