"""The OpenAI API beyond plain generation, over real HTTP to a real Serve deployment of SmolLM2: penalties,
logit_bias, min_tokens, logprobs on both endpoints, echo, several prompts in one request, usage in
every chunk, unknown fields, structured outputs, and vLLM's /tokenize and /detokenize. Every output is checked against
kvloom's offline engine given the same sampling parameters (float32: both are exact). And the README's examples,
run as written against this deployment."""

import json
import re
import shlex
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from kvloom.cluster.config import ClusterConfig
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32"}
SHARED_APP = "smollm2"  # the app these modules serve is one: conftest.deploy starts it once for them all
PROMPTS = ["The three most useful kitchen tools are", "My favourite season is autumn because",
           "To learn a language quickly, you should"]
QUESTION = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]


@pytest.fixture(scope="module")
def base(ray_serve, deploy_app) -> str:
    deploy_app(ClusterConfig.model_validate({"engine": ENGINE, "num_replicas": 1}))
    return ray_serve


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline(smollm2_dir) -> LLMEngine:
    return LLMEngine(model="smollm2", **ENGINE)


def offline_output(engine: LLMEngine, prompt, **knobs):
    engine.add_request("offline", prompt, SamplingParams(temperature=0, **knobs))
    while engine.has_unfinished():
        done = [o for o in engine.step() if o.finished]
    return done[0].outputs[0]


def sse_events(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- sampling knobs --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_greedy(offline):
    """The first prompt's greedy output, EOS ignored, with no knob: what each knob must change."""
    return offline_output(offline, PROMPTS[0], max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("knobs", [
    {"presence_penalty": 2.0}, {"frequency_penalty": 1.5, "presence_penalty": -0.5}, {"repetition_penalty": 1.5},
    {"logit_bias": {"11": 4.0, "28": -100}},
], ids=["presence", "frequency+presence", "repetition", "logit_bias"])
def test_penalties_and_logit_bias_match_the_offline_engine(client, offline, plain_greedy, knobs):
    """Long enough (EOS ignored) that the plain greedy text repeats itself, so each knob changes it."""
    extra = {"ignore_eos": True} | ({"repetition_penalty": knobs["repetition_penalty"]} if "repetition_penalty" in knobs else {})
    openai_knobs = {k: v for k, v in knobs.items() if k != "repetition_penalty"}
    result = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                       extra_body=extra, **openai_knobs)
    engine_knobs = {**knobs, "logit_bias": {int(k): v for k, v in knobs.get("logit_bias", {}).items()}}
    expected = offline_output(offline, PROMPTS[0], max_tokens=40, ignore_eos=True, **engine_knobs)
    assert result.choices[0].text == expected.text
    assert expected.token_ids != plain_greedy.token_ids, "the knob changes this output"


def test_min_tokens_keeps_a_short_answer_going(client, offline):
    plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 12
    longer = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40, temperature=0,
                                            extra_body={"min_tokens": 12})
    assert longer.usage.completion_tokens >= 12
    expected = offline_output(offline, offline.apply_chat_template(QUESTION), max_tokens=40, min_tokens=12)
    assert longer.choices[0].message.content == expected.text


def test_seeded_sampling_is_reproducible(client):
    runs = [client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7)
            for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text


# ---- vLLM's output fields: bad_words, allowed_token_ids, include_stop_str_in_output, skip_special_tokens, and
# truncate_prompt_tokens -------------------------------------------------------------------------------------------
def test_bad_words_and_allowed_token_ids_are_the_engines(client, offline, plain_greedy):
    plain = plain_greedy.token_ids
    tokenizer = offline.tokenizer
    # a word of the plain output that is one token with its leading space and one without: banned, it never comes
    banned = next(t for t in plain if (w := tokenizer.decode([t])).startswith(" ") and w[1:].isalpha()
                  and tokenizer.encode(w, add_special_tokens=False) == [t]
                  and len(tokenizer.encode(w[1:], add_special_tokens=False)) == 1)
    word = tokenizer.decode([banned]).strip()
    allowed = sorted(set(plain[::2]))
    assert not set(plain) <= set(allowed)
    for knobs in ({"bad_words": [word]}, {"allowed_token_ids": allowed}):
        got = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True, **knobs}).choices[0].text
        want = offline_output(offline, PROMPTS[0], max_tokens=40, ignore_eos=True, **knobs)
        assert got == want.text != plain_greedy.text
        if "bad_words" in knobs:
            assert banned not in want.token_ids
        else:
            assert set(want.token_ids) <= set(allowed)


def test_include_stop_str_in_output_keeps_the_stop_string_streamed_or_not(client, base, plain_greedy):
    text = plain_greedy.text
    stop = text.split()[3]
    body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": True}
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["text"] == text[: text.index(stop) + len(stop)] and whole["finish_reason"] == "stop"
    streamed = "".join(e["choices"][0]["text"] for e in sse_events(base, "/v1/completions", body))
    assert streamed == whole["text"]
    cut = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert cut == text[: text.index(stop)]


def test_skip_special_tokens_off_shows_special_tokens_and_with_include_stop_str_the_eos(client, base):
    plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=20, temperature=0).choices[0]
    assert plain.finish_reason == "stop"
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 20, "temperature": 0,
            "include_stop_str_in_output": True, "skip_special_tokens": False}
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["message"]["content"] == plain.message.content + "<|im_end|>"
    events = sse_events(base, "/v1/chat/completions", body)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == whole["message"]["content"]
    kept = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=3, extra_body={
        "logit_bias": {"0": 100}, "ignore_eos": True, "skip_special_tokens": False}).choices[0].text
    assert kept == "<|endoftext|>" * 3


def test_truncate_prompt_tokens_keeps_the_last_tokens_on_both_endpoints(client, offline):
    ids = offline.encode(PROMPTS[1])
    got = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4})
    assert got.usage.prompt_tokens == 4 < len(ids)
    assert got.choices[0].text == offline_output(offline, ids[-4:], max_tokens=6).text
    chat_ids = offline.apply_chat_template(QUESTION)
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 9})
    assert chat.usage.prompt_tokens == 9 < len(chat_ids)
    assert chat.choices[0].message.content == offline_output(offline, chat_ids[-9:], max_tokens=6).text


# ---- logprobs ----------------------------------------------------------------------------------
def test_completion_logprobs_are_the_engines(client, offline):
    result = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    expected = offline_output(offline, PROMPTS[0], max_tokens=8, logprobs=3)
    lp = result.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([next(iter(d.values())) for d in expected.logprobs], abs=1e-5)
    assert "".join(lp.tokens) == result.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 3 and max(top.values()) >= chosen - 1e-6
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_logprobs_streamed_equal_whole(client, base):
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    # the EOS token that ended it is listed (it was generated) though the text leaves it out, as in vLLM
    assert "".join(c.token for c in content).removesuffix("<|im_end|>") == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    events = sse_events(base, "/v1/chat/completions", {"model": "smollm2", "messages": QUESTION, "max_tokens": 8,
                                                       "temperature": 0, "logprobs": True, "top_logprobs": 2})
    streamed = [c for e in events for c in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [(c["token"], c["logprob"]) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_no_logprobs_unless_asked(client):
    result = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4)
    assert result.choices[0].logprobs is None


# ---- prompts ------------------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_the_output(client, base):
    result = client.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True)
    plain = client.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=6, temperature=0)
    assert result.choices[0].text == PROMPTS[2] + plain.choices[0].text
    events = sse_events(base, "/v1/completions", {"model": "smollm2", "prompt": PROMPTS[2], "max_tokens": 6,
                                                  "temperature": 0, "echo": True})
    assert "".join(e["choices"][0]["text"] for e in events) == result.choices[0].text


def test_several_prompts_are_several_choices(client, base, offline):
    result = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=10, temperature=0)
    expected = [offline_output(offline, p, max_tokens=10) for p in PROMPTS]
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [e.text for e in expected]
    assert result.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert result.usage.prompt_tokens == sum(len(offline.encode(p)) for p in PROMPTS)

    events = sse_events(base, "/v1/completions", {"model": "smollm2", "prompt": PROMPTS, "max_tokens": 10,
                                                  "temperature": 0, "stream_options": {"include_usage": True}})
    texts = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(3)] == [e.text for e in expected]
    assert events[-1]["usage"]["completion_tokens"] == result.usage.completion_tokens


def test_token_id_prompts_too(client, offline):
    ids = [offline.encode(p) for p in PROMPTS[:2]]
    result = client.completions.create(model="smollm2", prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in result.choices] == [offline_output(offline, i, max_tokens=5).text for i in ids]


# ---- streaming usage and fields ------------------------------------------------------------------
def test_continuous_usage_stats_in_every_chunk(base):
    """What guidellm sends: usage in every chunk, and ignore_eos."""
    events = sse_events(base, "/v1/completions", {
        "model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 12, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 12
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in events)


def test_echo_with_logprobs_leads_with_the_prompts_tokens_as_lm_eval_reads_them(client, offline):
    """What lm-evaluation-harness's local-completions sends for a loglikelihood: the prompt echoed with its tokens'
    logprobs (the first null), equal to the engine's prompt logprobs, then the generated token's."""
    got = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True,
                                    logprobs=1).choices[0]
    ids = offline.encode(PROMPTS[1])
    offline.add_request("echo", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1))
    while offline.has_unfinished():
        done = [o for o in offline.step() if o.finished]
    want = [None] + [done[0].prompt_logprobs[i][1][ids[i]] for i in range(1, len(ids))]
    lp = got.logprobs
    assert len(lp.tokens) == len(ids) + 1 and "".join(lp.tokens) == got.text and got.text.startswith(PROMPTS[1])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(want[1:], abs=1e-5)


def test_prompt_logprobs_on_completions_and_chat_are_vllms_shape(client, offline):
    completion = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 2}).choices[0]
    entries = completion.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(offline.encode(PROMPTS[0]))
    for entry in entries[1:]:
        (chosen, first), *alternatives = entry.items()
        assert first["rank"] >= 1 and [a["rank"] for _, a in alternatives] == [1, 2][: len(alternatives)]
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0}).choices[0]
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in client.completions.create(model="smollm2", prompt=PROMPTS[0],
                                                               max_tokens=2).choices[0].model_extra


def test_unknown_bookkeeping_fields_are_accepted_and_output_changing_ones_refused(client, base):
    result = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=3, extra_body={
        "metadata": {"team": "a"}, "store": False, "vendor_x": 1, "use_beam_search": False,
        "modalities": ["text"]})  # the last two: what kvloom does anyway
    assert result.choices[0].text
    for field, value in [("use_beam_search", True), ("guided_grammar", "root ::= \"a\""), ("length_penalty", 0.5)]:
        response = httpx.post(f"{base}/v1/completions", timeout=60,
                              json={"model": "smollm2", "prompt": "hi", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt": ["a"] * 65}, "prompt"), ({"seed": 2**63}, "seed"),
    ({"allowed_token_ids": [999999]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2044}, "truncate_prompt_tokens"),  # max_model_len 2048 less max_tokens 16: 2032
])
def test_bad_values_get_a_400_naming_the_field(base, body, param):
    response = httpx.post(f"{base}/v1/completions", json={"model": "smollm2", "prompt": "hi", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"]["param"] or "")


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", r'{"model": "smollm2", "prompt": "a \ud83d b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"model": "smollm2", "prompt": ["ok", "\uDC00"], "max_tokens": 2}', "prompt.1"),
    ("/v1/chat/completions", r'{"model": "smollm2", "messages": [{"role": "user", "content": "\ud800"}]}',
     "messages.0.content"),
    ("/v1/completions", r'{"model": "\ud83d", "prompt": "hi"}', "model"),
])
def test_text_that_is_not_valid_unicode_is_a_400_naming_the_field(base, path, raw, param):
    """JSON can escape a lone UTF-16 surrogate; no tokenizer takes the string it decodes to."""
    response = httpx.post(f"{base}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_escaped_surrogate_pairs_are_text_like_any_other(base, offline):
    raw = r'{"model": "smollm2", "prompt": "\ud83d\ude00 is", "max_tokens": 3, "temperature": 0}'
    response = httpx.post(f"{base}/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.json()["choices"][0]["text"] == offline_output(offline, "\U0001F600 is", max_tokens=3).text


# ---- n choices ---------------------------------------------------------------------------------------
LONG_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle on the shore"


def test_n_greedy_choices_are_the_engines_output_and_count_the_prompt_once(client, offline):
    want = offline_output(offline, LONG_PROMPT, max_tokens=8)
    result = client.completions.create(model="smollm2", prompt=LONG_PROMPT, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.text == want.text for c in result.choices)
    assert result.usage.completion_tokens == 3 * len(want.token_ids)
    assert result.usage.prompt_tokens == len(offline.encode(LONG_PROMPT))  # as OpenAI and vLLM count it


def test_later_choices_fork_the_first_ones_prompt_kv(base, offline):
    """Each choice's own counts (continuous usage): choices 1 and 2 compute only the prompt's last token."""
    events = sse_events(base, "/v1/completions", {
        "model": "smollm2", "prompt": LONG_PROMPT + " again", "max_tokens": 8, "ignore_eos": True, "temperature": 0,
        "n": 3, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    prompt = len(offline.encode(LONG_PROMPT + " again"))
    cached = {e["choices"][0]["index"]: e["usage"]["prompt_tokens_details"]["cached_tokens"] for e in events[:-1]}
    assert cached[1] == cached[2] == prompt - 1
    assert events[-1]["usage"]["prompt_tokens"] == prompt
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached[0] < prompt - 1


def test_n_seeded_choices_are_the_seeds_in_turn(client):
    together = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=10, seed=5, n=2)
    apart = [client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=10, seed=seed).choices[0].text
             for seed in (5, 6)]
    assert [c.text for c in together.choices] == apart


def test_best_of_returns_the_n_most_likely_of_its_candidates(client):
    """best_of=4, n=2 generates what n=4 does (candidate j draws with seed + j) and returns the two whose tokens
    have the highest summed logprob, most likely first; usage counts all four."""
    kwargs = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 10, "seed": 5, "temperature": 1.0}
    candidates = client.completions.create(**kwargs, n=4, logprobs=0).choices
    ranked = sorted(candidates, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**kwargs, n=2, best_of=4)
    assert [(c.index, c.text, c.logprobs) for c in best.choices] == [(0, ranked[0].text, None), (1, ranked[1].text, None)]
    assert best.usage.completion_tokens == 40


def test_n_chat_choices_stream_by_index(client):
    kwargs = {"model": "smollm2", "messages": QUESTION, "max_tokens": 12, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


# ---- structured outputs ------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_parses_and_streams_the_same(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, seed=7,
                                           temperature=temperature, response_format=fmt)
    person = json.loads(whole.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and 0 <= person["age"] <= 120
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, seed=7,
                                            temperature=temperature, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content


def test_json_object_and_vllm_constraint_fields(client):
    obj = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=80, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for extra, check in [
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"guided_regex": "[A-Z][a-z]{2,8} [0-9]{2}"}, lambda text: re.fullmatch("[A-Z][a-z]{2,8} [0-9]{2}", text)),
        ({"guided_json": json.dumps(PERSON)}, lambda text: set(json.loads(text)) == {"name", "age"}),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda text: text in ("red", "green")),
    ]:
        text = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                         extra_body=extra).choices[0].text
        assert check(text), (extra, text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": [1, {}]}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(base, body, param):
    response = httpx.post(f"{base}/v1/completions", json={"model": "smollm2", "prompt": "hi", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


# ---- vLLM's token endpoints and /v1/models ----------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(base, offline):
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": PROMPTS[0]}, timeout=30).json()
    assert tokens["tokens"] == offline.encode(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == ENGINE["max_model_len"]
    back = httpx.post(f"{base}/detokenize", json={"model": "smollm2", "tokens": tokens["tokens"]}, timeout=30)
    assert back.json() == {"prompt": PROMPTS[0]}
    chat = httpx.post(f"{base}/tokenize", json={"messages": QUESTION}, timeout=30).json()
    assert chat["tokens"] == offline.apply_chat_template(QUESTION)
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_models_lists_max_model_len(base):
    (model,) = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    assert model["id"] == "smollm2" and model["max_model_len"] == ENGINE["max_model_len"]


# ---- the README's examples, run as written -------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"
DOCUMENTED_BASE = "127.0.0.1:8000"


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def curl_examples() -> list[tuple[list[str], str]]:
    """Each `$ curl` command of the README's console blocks (continuation lines joined) and the output shown."""
    examples = []
    for block in readme_blocks("console"):
        for command, output in re.findall(r"^\$ (curl .*?)\n(\{.*?)(?=^\$ |\Z)", block, re.S | re.M):
            examples.append((shlex.split(command.replace("\\\n", " ")), output))
    return examples


def send_curl(base: str, argv: list[str]) -> httpx.Response:
    """What curl would send for `argv` (its -s, -H and -d flags), to this test's server instead of port 8000."""
    headers, body, url = {}, None, None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            body = next(args)
        elif not arg.startswith("-"):
            url = arg
    url = (url if "://" in url else f"http://{url}").replace(DOCUMENTED_BASE, base.removeprefix("http://"))
    return httpx.request("POST" if body is not None else "GET", url, headers=headers, content=body, timeout=120)


def test_the_readme_shows_curl_examples_and_each_answers_in_the_shape_shown(base):
    examples = curl_examples()
    assert len(examples) >= 4
    for argv, shown in examples:
        response = send_curl(base, argv)
        got = response.json()
        documented = json.loads(re.sub(r", \.\.\.", "", shown.replace("\n", "")))  # the sample elides a little
        assert set(got) == set(documented), (argv, got)
        if "error" in documented:
            assert response.status_code == 400 and got["error"]["param"] == documented["error"]["param"], got
        else:
            assert response.status_code == 200 and len(got["choices"]) == len(documented["choices"]), got
            assert got["object"] == documented["object"] and set(got["usage"]) == set(documented["usage"])


def test_the_readmes_python_examples_run_as_written(base, capsys):
    """The OpenAI client example against this test's server, and the offline engine example."""
    blocks = readme_blocks("python")
    assert len(blocks) == 2
    client_example, offline_example = blocks
    exec(compile(client_example.replace(DOCUMENTED_BASE, base.removeprefix("http://")), "README", "exec"), {})
    exec(compile(offline_example, "README", "exec"), {})
    printed = capsys.readouterr().out
    assert "Paris" in printed and len(printed.splitlines()) >= 3


def test_every_config_the_readme_shows_is_a_valid_cluster_config():
    blocks = readme_blocks("yaml")
    assert len(blocks) >= 3
    for block in blocks:
        ClusterConfig.model_validate(yaml.safe_load(block))
