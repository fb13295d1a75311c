"""The offline `LLM` takes prompts and conversations as vLLM's does (one, or a list), and a bad one among
many raises, naming its field, before anything is queued."""

import pytest

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
POOL = 1 << 24  # KV bytes: room for these prompts (the default 2 GiB costs an engine 1-7 s to fault in here)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=POOL)


def test_one_prompt_is_a_batch_of_one_whether_text_or_token_ids(tiny_llm):
    (from_text,) = tiny_llm.generate("w5 w6 w7", GREEDY)
    (from_ids,) = tiny_llm.generate(from_text.prompt_token_ids, GREEDY)
    assert from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids and len(from_ids.outputs[0].token_ids) == 4
    assert [len(o.outputs[0].token_ids) for o in tiny_llm.generate(["w5", [5, 6]], GREEDY)] == [4, 4]


@pytest.mark.parametrize("prompts, field", [
    (["w5 w6", "w7 \ud800 w8"], "prompt"),  # a lone surrogate: the tokenizer's own error named nothing
    (["w5 w6", [5, 10**6]], "prompt"),
    (["w5 w6", "w7"], "params"),
], ids=["text-not-unicode", "token-outside-vocabulary", "fewer-params-than-prompts"])
def test_a_bad_prompt_among_many_raises_before_any_is_queued(tiny_llm, prompts, field):
    params = [GREEDY] if field == "params" else GREEDY
    with pytest.raises(InvalidRequestError) as info:
        tiny_llm.generate(prompts, params)
    assert info.value.field == field
    engine = tiny_llm.engine
    assert not engine.has_unfinished() and engine.stats().num_free_blocks == engine.stats().num_blocks
    assert [len(o.outputs[0].token_ids) for o in tiny_llm.generate(["w5", "w6"], GREEDY)] == [4, 4]


def test_chat_takes_one_conversation_or_several_and_names_text_that_is_not_unicode():
    llm = LLM(model="smollm2", dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    question = [{"role": "user", "content": "Say hi."}]
    (one,) = llm.chat(question, GREEDY)
    assert [o.outputs[0].token_ids for o in llm.chat([question, question], GREEDY)] == [one.outputs[0].token_ids] * 2
    with pytest.raises(InvalidRequestError) as info:
        llm.chat([{"role": "user", "content": "hi \udc80"}], GREEDY)
    assert info.value.field == "messages" and "not valid Unicode" in str(info.value)


def test_vllms_prompt_and_token_fields_apply_offline_too(tiny_llm):
    """truncate_prompt_tokens keeps the prompt's last tokens; allowed_token_ids less a bad word leaves one token."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=2,
                            allowed_token_ids=[7, 9], bad_words=["w9"])
    (out,) = tiny_llm.generate("w5 w6 w7 w8", params)
    assert out.prompt_token_ids == [7, 8] and out.outputs[0].token_ids == [7] * 4
