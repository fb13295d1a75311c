"""A stream whose replica died goes on on another engine from the tokens its client has.

The router sends the prompt, the output tokens already streamed and how many characters of text the
client got; the new engine takes the tokens as output it generated (max_tokens, penalties, a grammar and
stop strings go on from them), recomputes them, and streams on. In float32 the text the client sees is
the uninterrupted run's, character for character: text the first engine held back for a stop string
comes out once, and a seeded sample draws what it would have drawn.
"""

import pytest

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.outputs import RequestOutput
from kvloom.engine.sampling import SamplingParams, StructuredOutputs

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def smollm2() -> LLMEngine:
    return LLMEngine(model="smollm2", dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def first() -> LLMEngine:
    return smollm2()


@pytest.fixture(scope="module")
def second() -> LLMEngine:
    return smollm2()


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams,
           continued: tuple[list[int], int] | None = None) -> list[RequestOutput]:
    """Every output of one request; `continued` = (output tokens the client has, characters it has)."""
    request = engine.make_request("r", prompt, params)
    if continued:
        engine.add_continued(request, *continued)
    else:
        engine.add_prepared(request)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def cut_after(outputs: list[RequestOutput], k: int) -> tuple[list[int], int, str]:
    """What a client has after the first `k` outputs: their tokens, and the text streamed."""
    text = "".join(o.outputs[0].delta_text for o in outputs[:k])
    return [t for o in outputs[:k] for t in o.outputs[0].delta_token_ids], len(text), text


@pytest.mark.parametrize("knobs", [
    {"temperature": 0, "stop": ["zzzz-never-there"], "frequency_penalty": 0.6},  # text held back; penalties
    {"temperature": 0.9, "seed": 7, "presence_penalty": 0.4},
    {"temperature": 0.7, "seed": 3, "structured_outputs": StructuredOutputs(json_object=True)},
], ids=["greedy-stop-penalty", "seeded-sample", "seeded-json-grammar"])
def test_the_continued_stream_is_the_uninterrupted_one(first, second, knobs):
    params = SamplingParams(max_tokens=40, ignore_eos=True, **knobs)
    prompt = first.apply_chat_template([{"role": "user", "content": PROMPT}])
    whole = stream(first, prompt, params)
    tokens, chars, client_text = cut_after(whole, 12)
    if "stop" in knobs:  # the first engine held text back for the stop string: the client is behind
        assert chars < len(first.tokenizer.decode(tokens, skip_special_tokens=True))

    rest = stream(second, prompt, params, (tokens, chars))
    assert [t for o in rest for t in o.outputs[0].delta_token_ids] == whole[-1].outputs[0].token_ids[len(tokens):]
    assert client_text + "".join(o.outputs[0].delta_text for o in rest) == whole[-1].outputs[0].text
    assert rest[-1].outputs[0].token_ids == whole[-1].outputs[0].token_ids  # the whole output, as usage counts it
    assert rest[-1].outputs[0].finish_reason == whole[-1].outputs[0].finish_reason
    assert second.kv.pool.num_used == 0 and not second.requests


def test_a_continuation_that_cannot_go_on_is_refused_by_name_and_holds_nothing(second):
    params = SamplingParams(max_tokens=4, temperature=0)
    for output in ([1, 2, 3, 4], [10**7]):  # max_tokens already reached; a token outside the vocabulary
        with pytest.raises(InvalidRequestError) as err:
            second.add_continued(second.make_request("bad", [1, 2, 3], params), output, 0)
        assert err.value.field == "output_token_ids"
    assert not second.requests and not second.has_unfinished()
