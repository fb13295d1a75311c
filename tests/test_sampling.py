"""What each SamplingParams knob does to the tokens and text a request gets back.

Sampling is per request: a seeded request's i-th token draws from (seed, i) alone, so it gets the same
tokens alone or batched with any neighbours in any order. top_k=1, a tiny top_p and temperature 0
all reduce to greedy. Penalties, logit_bias and min_tokens follow their OpenAI and vLLM definitions, and so do
vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens.
logprobs are the model's log-softmax (raw logits, before temperature), the chosen token first. Stops end a request with finish_reason "stop" and say why in stop_reason. On
the real SmolLM2 model, stop strings are cut from the text (or kept at its end, with
include_stop_str_in_output) and the streamed deltas never show a character that the final text does not
keep; a stop token's text and special tokens' text follow vLLM's rules.

Most cases use the tiny random Llama (fast); text-level behaviour uses SmolLM2.
"""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

PROMPTS = {
    "a": [5, 17, 42, 99, 7, 300, 12],
    "b": [400, 401, 402],
    "c": list(range(30, 70)),
    "d": [250, 3, 77, 77, 9],
}
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def tiny_engine(model_dir, **overrides) -> LLMEngine:
    block_bytes = ModelConfig.from_dir(model_dir).kv_bytes_per_token(torch.float32) * 4
    settings = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=4, max_model_len=256,
                    kv_cache_memory_bytes=256 * block_bytes, max_num_seqs=8)
    return LLMEngine(**{**settings, **overrides})


def run(engine: LLMEngine, jobs: dict, arrivals: dict[int, list[str]] | None = None):
    """Run requests `{id: (prompt, params)}` to completion, adding them at the steps in `arrivals`.

    Returns ({id: final RequestOutput}, {id: [every RequestOutput streamed for it]}).
    """
    pending = dict(arrivals or {0: list(jobs)})
    finished, streams = {}, {rid: [] for rid in jobs}
    step = 0
    while pending or engine.has_unfinished():
        for rid in pending.pop(step, []):
            engine.add_request(rid, *jobs[rid])
        for output in engine.step():
            streams[output.request_id].append(output)
            if output.finished:
                finished[output.request_id] = output
        step += 1
        assert step < 10_000
    return finished, streams


def tokens_of(model_dir, prompt, params, **engine_overrides) -> list[int]:
    finished, _ = run(tiny_engine(model_dir, **engine_overrides), {"x": (prompt, params)})
    return finished["x"].outputs[0].token_ids


@pytest.fixture(scope="module")
def greedy_tokens(tiny_model_dir) -> dict[str, list[int]]:
    finished, _ = run(tiny_engine(tiny_model_dir), {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    return {rid: out.outputs[0].token_ids for rid, out in finished.items()}


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


# ---- seeds -----------------------------------------------------------------------------------
def sampled(seed: int | None, **knobs) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=1.0, seed=seed, ignore_eos=True, **knobs)


def test_greedy_matches_transformers_generate(tiny_model_dir, greedy_tokens, greedy_reference):
    want = greedy_reference(tiny_model_dir, [PROMPTS["a"], PROMPTS["c"]], NEW)
    assert [greedy_tokens["a"], greedy_tokens["c"]] == want


def test_seeded_request_is_reproducible_whatever_its_batch(tiny_model_dir, greedy_tokens):
    alone = tokens_of(tiny_model_dir, PROMPTS["a"], sampled(1234))
    assert alone != greedy_tokens["a"], "temperature 1 actually samples"

    # same engine seed or not, batched with sampling neighbours, in different orders and timings
    neighbours = {"b": (PROMPTS["b"], sampled(None)), "c": (PROMPTS["c"], sampled(7)),
                  "d": (PROMPTS["d"], sampled(1234))}
    layouts = [
        ({}, {0: ["b", "a", "c", "d"]}),
        ({"seed": 99}, {0: ["d", "c"], 2: ["a"], 5: ["b"]}),
        ({"max_num_batched_tokens": 8}, {0: ["c", "b"], 1: ["d", "a"]}),  # chunked prefill
    ]
    for overrides, arrivals in layouts:
        engine = tiny_engine(tiny_model_dir, **overrides)
        finished, _ = run(engine, {"a": (PROMPTS["a"], sampled(1234)), **neighbours}, arrivals)
        assert finished["a"].outputs[0].token_ids == alone, (overrides, arrivals)


def test_different_seeds_give_different_tokens(tiny_model_dir):
    runs = [tokens_of(tiny_model_dir, PROMPTS["a"], sampled(seed)) for seed in (1, 2, 3)]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


def test_unseeded_requests_are_not_all_alike(tiny_model_dir):
    finished, _ = run(tiny_engine(tiny_model_dir), {f"r{i}": (PROMPTS["a"], sampled(None)) for i in range(3)})
    outs = [o.outputs[0].token_ids for o in finished.values()]
    assert len({tuple(o) for o in outs}) == 3


# ---- knobs that reduce to greedy -------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        pytest.param(sampled(5, top_k=1), id="top_k=1"),
        pytest.param(SamplingParams(max_tokens=NEW, temperature=1.5, top_k=1, seed=6, ignore_eos=True), id="top_k=1-hot"),
        pytest.param(sampled(5, top_p=1e-6), id="top_p-tiny"),
        pytest.param(SamplingParams(max_tokens=NEW, temperature=0, seed=5, ignore_eos=True), id="temperature=0-seed5"),
        pytest.param(SamplingParams(max_tokens=NEW, temperature=0, seed=6, top_k=50, top_p=0.5, ignore_eos=True),
                     id="temperature=0-ignores-top_k-top_p"),
    ],
)
def test_knobs_that_leave_one_candidate_are_greedy(tiny_model_dir, greedy_tokens, params):
    finished, _ = run(tiny_engine(tiny_model_dir),
                      {rid: (PROMPTS[rid], params) for rid in ("a", "c")} | {"b": (PROMPTS["b"], sampled(1))})
    assert finished["a"].outputs[0].token_ids == greedy_tokens["a"]
    assert finished["c"].outputs[0].token_ids == greedy_tokens["c"]


def test_top_k_limits_choices_to_the_k_best(tiny_model_dir, hf_tiny):
    with torch.inference_mode():
        logits = hf_tiny(torch.tensor([PROMPTS["b"]])).logits[0, -1]
    allowed = set(torch.topk(logits, 3).indices.tolist())
    jobs = {f"s{seed}": (PROMPTS["b"], SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=seed))
            for seed in range(40)}
    finished, _ = run(tiny_engine(tiny_model_dir), jobs)
    seen = {out.outputs[0].token_ids[0] for out in finished.values()}
    assert seen <= allowed
    assert len(seen) > 1, "top_k=3 at temperature 2 is not greedy"


def test_sampled_tokens_follow_the_softmax_at_the_temperature(tiny_model_dir, hf_tiny):
    with torch.inference_mode():
        logits = hf_tiny(torch.tensor([PROMPTS["b"]])).logits[0, -1]
    top = torch.topk(logits, 4)
    expected = dict(zip(top.indices.tolist(), (top.values / 2.0).softmax(-1).tolist()))
    draws = 400
    jobs = {f"s{seed}": (PROMPTS["b"], SamplingParams(max_tokens=1, temperature=2.0, top_k=4, seed=seed))
            for seed in range(draws)}
    finished, _ = run(tiny_engine(tiny_model_dir), jobs)
    tokens = [out.outputs[0].token_ids[0] for out in finished.values()]
    assert set(tokens) <= set(expected)
    for token, p in expected.items():  # 4 standard errors of a binomial share: fails only on a wrong law
        assert abs(tokens.count(token) / draws - p) < 4 * (p * (1 - p) / draws) ** 0.5 + 1e-3, (token, p)


# ---- logprobs --------------------------------------------------------------------------------
def hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position that predicted an output token."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].float().log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_chosen_token_and_the_top_k(tiny_model_dir, hf_tiny, temperature):
    ks = [0, 1, 5, 20]
    jobs = {f"k{k}": (PROMPTS["a"], SamplingParams(max_tokens=8, temperature=temperature, seed=3 + k, logprobs=k,
                                                   ignore_eos=True)) for k in ks}
    finished, streams = run(tiny_engine(tiny_model_dir), {**jobs, "none": (PROMPTS["b"], GREEDY)})
    assert finished["none"].outputs[0].logprobs is None, "only requests that ask get logprobs"
    for k in ks:
        out = finished[f"k{k}"].outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == 8
        want = hf_logprobs(hf_tiny, PROMPTS["a"], out.token_ids)

        # the first generated token, spelled out: its logprob is log_softmax of the model's logits
        first = out.token_ids[0]
        assert next(iter(out.logprobs[0])) == first
        assert out.logprobs[0][first] == pytest.approx(float(want[0, first]), abs=1e-4)

        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert list(entry)[0] == token, "the chosen token comes first"
            top_k = set(torch.topk(want[step], k).indices.tolist()) if k else set()
            assert set(entry) == {token} | top_k, f"k={k} step {step}: the chosen token plus the top {k}"
            assert all(value <= 0 for value in entry.values())
            for t, value in entry.items():
                assert value == pytest.approx(float(want[step, t]), abs=1e-4)
        if temperature == 0:
            assert all(entry[t] == max(entry.values()) for t, entry in zip(out.token_ids, out.logprobs))
        # the streamed outputs carry the logprobs so far
        assert [len(o.outputs[0].logprobs) for o in streams[f"k{k}"]] == list(range(1, 9))
    if temperature > 0:
        chosen_is_top = [entry[t] == max(entry.values())
                         for k in ks for t, entry in zip(finished[f"k{k}"].outputs[0].token_ids,
                                                         finished[f"k{k}"].outputs[0].logprobs)]
        assert not all(chosen_is_top), "sampled tokens are not all the argmax: logprobs follow the sample"


# ---- stops -----------------------------------------------------------------------------------
def test_max_tokens_finishes_with_length(tiny_model_dir, greedy_tokens):
    finished, _ = run(tiny_engine(tiny_model_dir), {"a": (PROMPTS["a"], GREEDY.model_copy(update={"max_tokens": 5}))})
    out = finished["a"].outputs[0]
    assert out.token_ids == greedy_tokens["a"][:5]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def first_fresh_token(tokens: list[int], at_least: int) -> tuple[int, int]:
    """A token id from `tokens` whose first occurrence is at index >= at_least, and that index."""
    for index in range(at_least, len(tokens)):
        if tokens.index(tokens[index]) == index:
            return tokens[index], index
    raise AssertionError("greedy output repeats itself; pick another prompt")


def test_stop_token_ids_end_the_request(tiny_model_dir, greedy_tokens):
    stop_id, index = first_fresh_token(greedy_tokens["a"], 3)
    params = GREEDY.model_copy(update={"stop_token_ids": [stop_id, 1]})
    finished, streams = run(tiny_engine(tiny_model_dir), {"a": (PROMPTS["a"], params), "b": (PROMPTS["b"], GREEDY)})
    out = finished["a"].outputs[0]
    assert out.token_ids == greedy_tokens["a"][: index + 1], "stops at the first stop token, which is kept"
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert [o.finished for o in streams["a"]] == [False] * index + [True]
    assert finished["b"].outputs[0].token_ids == greedy_tokens["b"], "the neighbour is unaffected"


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory, greedy_tokens):
    """The tiny model with a generation config that also ends on a token greedy decoding emits."""
    eos_id, index = first_fresh_token(greedy_tokens["a"], 4)
    model_dir = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, eos_id]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    return model_dir, eos_id, index


def test_eos_stops_unless_ignore_eos(eos_model, greedy_tokens):
    model_dir, eos_id, index = eos_model
    stops = tokens_of(model_dir, PROMPTS["a"], GREEDY.model_copy(update={"ignore_eos": False}))
    assert stops == greedy_tokens["a"][: index + 1]

    finished, _ = run(tiny_engine(model_dir), {"a": (PROMPTS["a"], GREEDY.model_copy(update={"ignore_eos": False}))})
    assert (finished["a"].outputs[0].finish_reason, finished["a"].outputs[0].stop_reason) == ("stop", None)

    finished, _ = run(tiny_engine(model_dir), {"a": (PROMPTS["a"], GREEDY)})  # ignore_eos=True
    out = finished["a"].outputs[0]
    assert out.token_ids == greedy_tokens["a"], "continues past EOS to max_tokens"
    assert eos_id in out.token_ids
    assert out.finish_reason == "length"


# ---- text: stop strings and streaming, on SmolLM2 --------------------------------------------
SMOL_PROMPTS = ["Once upon a time, in a small village by the sea,", "The three most important things in life are"]
SMOL_NEW = 8
SMOL_GREEDY = SamplingParams(max_tokens=SMOL_NEW, temperature=0)


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> LLMEngine:
    return LLMEngine(dtype="float32", model=str(smollm2_dir), device="cpu", max_model_len=128, kv_cache_memory_bytes=24 << 20)


@pytest.fixture(scope="module")
def smol_plain(smol):
    """Greedy outputs without stop strings, and their streams."""
    return run(smol, {f"p{i}": (p, SMOL_GREEDY) for i, p in enumerate(SMOL_PROMPTS)})


def decode(engine: LLMEngine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def assert_stream_is_consistent(stream, final_text: str) -> None:
    """Deltas add up to the final text, and no delta ever shows text the final text does not keep."""
    shown = ""
    for output in stream:
        completion = output.outputs[0]
        shown += completion.delta_text
        assert final_text.startswith(shown), f"streamed {shown!r}, final text is {final_text!r}"
        assert completion.text == shown
    assert shown == final_text


def test_text_is_the_decoded_tokens_and_streams_add_up(smol, smol_plain):
    finished, streams = smol_plain
    for rid, out in finished.items():
        completion = out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == SMOL_NEW
        assert completion.text == decode(smol, completion.token_ids)
        assert len(streams[rid]) == SMOL_NEW
        assert all(o.outputs[0].delta_text for o in streams[rid][1:]), "without stop strings text is not held"
        assert_stream_is_consistent(streams[rid], completion.text)


def stop_across_tokens(engine: LLMEngine, tokens: list[int]) -> tuple[str, int, int]:
    """A stop string made of the end of one token and the start of the next (first occurrence).

    Returns (stop, char offset where it starts, index of the token that completes it). Its first
    characters arrive one step before the rest, so only hold-back keeps them off the stream.
    """
    text = decode(engine, tokens)
    ends = [len(decode(engine, tokens[: i + 1])) for i in range(len(tokens))]
    for i in range(2, len(tokens) - 1):
        start, mid, end = ends[i - 1], ends[i], ends[i + 1]
        if mid - start >= 3 and end - mid >= 3:
            stop = text[mid - 2 : mid + 2]
            if text.find(stop) == mid - 2 and stop.strip() == stop:
                return stop, mid - 2, i + 1
    raise AssertionError(f"no suitable stop string in the greedy output {text!r}")


def test_stop_string_ends_generation_and_is_cut_from_the_text(smol, smol_plain):
    finished, _ = smol_plain
    plain_tokens = finished["p0"].outputs[0].token_ids
    plain_text = finished["p0"].outputs[0].text
    stop, at, completing = stop_across_tokens(smol, plain_tokens)

    never = "zzzz-no-such-text"
    outs, streams = run(smol, {
        "s": (SMOL_PROMPTS[0], SMOL_GREEDY.model_copy(update={"stop": [never, stop]})),
        "n": (SMOL_PROMPTS[1], SMOL_GREEDY.model_copy(update={"stop": [never], "max_tokens": 6})),
    })
    out = outs["s"].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == plain_tokens[: completing + 1], "stops on the token that completes the stop string"
    assert stop not in out.text
    assert out.text == plain_text[:at]
    decoded = decode(smol, out.token_ids)
    assert out.text == decoded[: decoded.index(stop)]
    # streaming: the first half of the stop string arrived a step before the rest, and was held back
    assert_stream_is_consistent(streams["s"], out.text)

    # a stop string that never matches only delays text: all of it streams out by the end
    neighbour = outs["n"].outputs[0]
    assert (neighbour.finish_reason, neighbour.stop_reason) == ("length", None)
    assert neighbour.token_ids == finished["p1"].outputs[0].token_ids[:6]
    assert neighbour.text == decode(smol, neighbour.token_ids)
    assert_stream_is_consistent(streams["n"], neighbour.text)


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(smol, smol_plain):
    finished, _ = smol_plain
    plain = finished["p0"].outputs[0]
    stop, at, completing = stop_across_tokens(smol, plain.token_ids)
    params = SMOL_GREEDY.model_copy(update={"stop": ["zzzz-no-such-text", stop], "include_stop_str_in_output": True})
    outs, streams = run(smol, {"s": (SMOL_PROMPTS[0], params)})
    out = outs["s"].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == plain.token_ids[: completing + 1]
    # the completing token's text after the stop string is cut, as vLLM cuts it
    assert out.text == plain.text[: at + len(stop)] and len(decode(smol, out.token_ids)) > len(out.text)
    assert_stream_is_consistent(streams["s"], out.text)


def test_a_stop_tokens_and_special_tokens_text_follow_vllms_rules(smol, smol_plain):
    """A stop token's (or EOS's) text is in the output only with include_stop_str_in_output, and a special token's
    only with skip_special_tokens off."""
    finished, _ = smol_plain
    plain = finished["p1"].outputs[0].token_ids
    eos, unk = 2, 0  # <|im_end|> and <|endoftext|>: special tokens
    stop_on = SMOL_GREEDY.model_copy(update={"stop_token_ids": [plain[1]]})
    eos_first = SMOL_GREEDY.model_copy(update={"logit_bias": {eos: 100.0}})
    unk_thrice = SMOL_GREEDY.model_copy(update={"logit_bias": {unk: 100.0}, "ignore_eos": True, "max_tokens": 3})
    jobs = {"stop": stop_on, "stop+": stop_on.model_copy(update={"include_stop_str_in_output": True}),
            "eos": eos_first.model_copy(update={"skip_special_tokens": False}),
            "eos+": eos_first.model_copy(update={"include_stop_str_in_output": True}),
            "eos+kept": eos_first.model_copy(update={"include_stop_str_in_output": True, "skip_special_tokens": False}),
            "unk": unk_thrice, "unk kept": unk_thrice.model_copy(update={"skip_special_tokens": False})}
    outs, streams = run(smol, {rid: (SMOL_PROMPTS[1], params) for rid, params in jobs.items()})
    texts = {rid: out.outputs[0].text for rid, out in outs.items()}
    special = smol.tokenizer.decode([eos]), smol.tokenizer.decode([unk])
    assert texts == {"stop": decode(smol, plain[:1]), "stop+": decode(smol, plain[:2]), "eos": "", "eos+": "",
                     "eos+kept": special[0], "unk": "", "unk kept": special[1] * 3}
    assert special == ("<|im_end|>", "<|endoftext|>")
    for rid, stream in streams.items():
        assert_stream_is_consistent(stream, texts[rid])


def test_bad_words_never_complete_and_change_nothing_before(smol, smol_plain):
    """vLLM's bad_words on a real tokenizer: each word as it starts a text and after a space; a word of several
    tokens loses its last one where the output ends with the others, a one-token word is never generated."""
    finished, _ = smol_plain
    plain = finished["p0"].outputs[0].token_ids  # ' there was a wise old wizard named'
    tokenizer = smol.tokenizer
    wizard = tokenizer.encode(" wizard", add_special_tokens=False)
    wise = tokenizer.encode(" wise", add_special_tokens=False)
    assert len(wizard) == 2 and len(wise) == 1
    at = next(i for i in range(len(plain)) if plain[i : i + 2] == wizard)
    outs, _ = run(smol, {"wizard": (SMOL_PROMPTS[0], SMOL_GREEDY.model_copy(update={"bad_words": ["wizard"]})),
                         "wise": (SMOL_PROMPTS[0], SMOL_GREEDY.model_copy(update={"bad_words": [" wise"]})),
                         "plain": (SMOL_PROMPTS[0], SMOL_GREEDY)})
    got = {rid: out.outputs[0].token_ids for rid, out in outs.items()}
    assert got["wizard"][: at + 1] == plain[: at + 1] and got["wizard"][at + 1] != wizard[1]
    assert not any(got["wizard"][i : i + 2] == wizard for i in range(len(got["wizard"])))
    assert got["wise"][: plain.index(wise[0])] == plain[: plain.index(wise[0])] and wise[0] not in got["wise"]
    assert got["plain"] == plain  # its neighbours' bans are theirs


# ---- penalties, logit_bias, min_tokens ---------------------------------------------------------
# They change a request's own logits before its token is chosen, as OpenAI (presence/frequency
# penalty, logit_bias) and vLLM (repetition_penalty, min_tokens) define them: checked against references
# written here from those definitions on transformers' float32 logits (where kvloom's float32 engine is
# token-identical), and against transformers' own processor where it has one. A neighbour in the same
# batch that asks for none of them gets exactly its plain greedy tokens.

@torch.inference_mode()
def reference_greedy(hf, prompt: list[int], adjust, steps: int = NEW) -> list[int]:
    """Greedy decoding where `adjust(logits, output_so_far)` edits each step's float32 logits."""
    ids, output = list(prompt), []
    for _ in range(steps):
        logits = hf(torch.tensor([ids])).logits[0, -1].clone()
        token = int(adjust(logits, output).argmax())
        ids.append(token)
        output.append(token)
    return output


def engine_tokens(model_dir, prompt: list[int], **knobs) -> tuple[list[int], list[int]]:
    """The request's tokens, and those of a plain greedy neighbour run in the same batch."""
    params = GREEDY.model_copy(update=knobs)
    finished, _ = run(tiny_engine(model_dir), {"x": (prompt, params), "b": (PROMPTS["b"], GREEDY)})
    return finished["x"].outputs[0].token_ids, finished["b"].outputs[0].token_ids


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.8), (0.7, 0.6), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_follow_openai_definition(tiny_model_dir, hf_tiny, greedy_tokens,
                                                                     presence, frequency):
    def openai(logits, output):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence
        for token in set(output):
            logits[token] -= output.count(token) * frequency + presence
        return logits

    got, neighbour = engine_tokens(tiny_model_dir, PROMPTS["d"], presence_penalty=presence,
                                   frequency_penalty=frequency)
    assert got == reference_greedy(hf_tiny, PROMPTS["d"], openai)
    assert neighbour == greedy_tokens["b"]


def test_a_positive_presence_penalty_changes_a_repetitive_output(tiny_model_dir, greedy_tokens):
    repeats = max(PROMPTS, key=lambda rid: len(greedy_tokens[rid]) - len(set(greedy_tokens[rid])))
    assert len(set(greedy_tokens[repeats])) < NEW, "the tiny model repeats itself somewhere"
    got, _ = engine_tokens(tiny_model_dir, PROMPTS[repeats], presence_penalty=2.0)
    assert len(set(got)) > len(set(greedy_tokens[repeats]))


@pytest.mark.parametrize("penalty", [2.0, 0.7])
def test_repetition_penalty_matches_transformers(tiny_model_dir, hf_tiny, greedy_tokens, penalty):
    prompt = PROMPTS["d"]
    with torch.inference_mode():
        want = hf_tiny.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, repetition_penalty=penalty,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    got, _ = engine_tokens(tiny_model_dir, prompt, repetition_penalty=penalty)
    assert got == want
    assert got != greedy_tokens["d"]


def test_logit_bias_forces_or_forbids_tokens(tiny_model_dir, greedy_tokens):
    forced, neighbour = engine_tokens(tiny_model_dir, PROMPTS["a"], logit_bias={123: 100.0})
    assert forced == [123] * NEW
    assert neighbour == greedy_tokens["b"]

    banned = set(greedy_tokens["a"])
    got, _ = engine_tokens(tiny_model_dir, PROMPTS["a"], logit_bias={t: -100.0 for t in banned})
    assert not banned & set(got)


def test_small_logit_bias_matches_reference(tiny_model_dir, hf_tiny):
    bias = {token: 2.5 for token in (11, 300, 500)} | {7: -3.0}

    def biased(logits, output):
        for token, value in bias.items():
            logits[token] += value
        return logits

    got, _ = engine_tokens(tiny_model_dir, PROMPTS["c"], logit_bias=bias)
    assert got == reference_greedy(hf_tiny, PROMPTS["c"], biased)


def test_min_tokens_holds_back_eos_and_stop_tokens(eos_model, hf_tiny, greedy_tokens):
    model_dir, eos_id, index = eos_model
    stops_early = GREEDY.model_copy(update={"ignore_eos": False})
    finished, _ = run(tiny_engine(model_dir), {"x": (PROMPTS["a"], stops_early)})
    assert finished["x"].outputs[0].token_ids == greedy_tokens["a"][: index + 1]

    min_tokens = index + 4
    stop_id = 300

    def banned_until_min(logits, output):
        if len(output) < min_tokens:
            logits[[2, eos_id, stop_id]] = float("-inf")
        return logits

    want = reference_greedy(hf_tiny, PROMPTS["a"], banned_until_min)
    ends = [i for i, t in enumerate(want) if t in (2, eos_id, stop_id)]
    want = want[: ends[0] + 1] if ends else want
    params = stops_early.model_copy(update={"min_tokens": min_tokens, "stop_token_ids": [stop_id]})
    finished, _ = run(tiny_engine(model_dir), {"x": (PROMPTS["a"], params)})
    out = finished["x"].outputs[0]
    assert out.token_ids == want
    assert len(out.token_ids) > min_tokens or out.finish_reason == "length"
    assert not {2, eos_id, stop_id} & set(out.token_ids[:min_tokens])


# ---- vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens --------------------------------------------
def test_allowed_token_ids_are_the_only_candidates(tiny_model_dir, hf_tiny, greedy_tokens):
    allowed = [3, 77, 123, 400, 511]
    assert not set(greedy_tokens["a"]) <= set(allowed)

    def only_allowed(logits, output):
        kept = torch.full_like(logits, float("-inf"))
        kept[allowed] = logits[allowed]
        return kept

    got, neighbour = engine_tokens(tiny_model_dir, PROMPTS["a"], allowed_token_ids=allowed)
    assert got == reference_greedy(hf_tiny, PROMPTS["a"], only_allowed)
    assert neighbour == greedy_tokens["b"]
    assert set(tokens_of(tiny_model_dir, PROMPTS["a"], sampled(5, allowed_token_ids=allowed))) <= set(allowed)


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest(tiny_model_dir, hf_tiny, greedy_tokens):
    """The tiny model's tokenizer has one token per word `wN`: a bad word of two such words is a two-token word."""
    plain = greedy_tokens["a"]
    pair, single = plain[3:5], plain[8]

    def banned(logits, output):
        if output[-1:] == pair[:1]:
            logits[pair[1]] = float("-inf")
        logits[single] = float("-inf")
        return logits

    got, neighbour = engine_tokens(tiny_model_dir, PROMPTS["a"], bad_words=[f"w{pair[0]} w{pair[1]}", f"w{single}"])
    assert got == reference_greedy(hf_tiny, PROMPTS["a"], banned)
    assert got[:4] == plain[:4] and got[4] != pair[1] and single not in got
    assert neighbour == greedy_tokens["b"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    prompt = PROMPTS["c"]
    finished, _ = run(engine, {"cut": (prompt, GREEDY.model_copy(update={"truncate_prompt_tokens": 7})),
                               "tail": (prompt[-7:], GREEDY)})
    assert finished["cut"].prompt_token_ids == prompt[-7:]
    assert finished["cut"].outputs[0].token_ids == finished["tail"].outputs[0].token_ids
    # -1: all that leave room for max_tokens (max_model_len is 256); the prompt alone would not fit
    long = [3 + t % 500 for t in range(300)]
    finished, _ = run(engine, {"fit": (long, GREEDY.model_copy(update={"truncate_prompt_tokens": -1}))})
    assert finished["fit"].prompt_token_ids == long[-(256 - NEW):]
    assert len(finished["fit"].outputs[0].token_ids) == NEW
    with pytest.raises(InvalidRequestError) as error:  # a length max_tokens leaves no room for, as vLLM refuses it
        engine.make_request("x", prompt, SamplingParams(max_tokens=NEW, truncate_prompt_tokens=256 - NEW + 1))
    assert error.value.field == "truncate_prompt_tokens"


def test_sampled_request_with_penalties_is_reproducible_by_seed(tiny_model_dir):
    params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=42, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={5: 1.0})
    runs = [run(tiny_engine(tiny_model_dir), {"x": (PROMPTS["a"], params)} | neighbours)[0]["x"].outputs[0].token_ids
            for neighbours in ({}, {"b": (PROMPTS["b"], GREEDY), "c": (PROMPTS["c"], params)})]
    assert runs[0] == runs[1]


def test_bad_values_are_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="outside"):
        SamplingParams(logit_bias={5: 150.0})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    for knobs in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2}, {"allowed_token_ids": []},
                  {"bad_words": ["w5"] * 129}):
        with pytest.raises(ValueError, match=next(iter(knobs))):
            SamplingParams(**knobs)
    engine = tiny_engine(tiny_model_dir)
    for knobs in ({"logit_bias": {10**6: 1.0}}, {"allowed_token_ids": [3, 512]}, {"bad_words": ["w5", " "]},
                  {"bad_words": [" ".join(["w5"] * 1025)]}):
        with pytest.raises(InvalidRequestError) as error:
            engine.make_request("x", PROMPTS["a"], SamplingParams(**knobs))
        assert error.value.field == next(iter(knobs))
