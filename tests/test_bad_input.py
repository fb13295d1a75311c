"""Bad input fails early, with an error naming the field at fault, and costs the engine nothing.

A serving engine is shared: one caller's malformed request or config must raise a clear error
(InvalidRequestError / ConfigError carry `.field` / `.key`; pydantic's ValidationError names the
field in its message) and must leave the engine exactly as able to serve as before. So every
case here is followed by a real request run to completion, and by a check that the idle engine
holds no KV blocks. Aborts, at any stage of a request's life, free everything it holds.
"""

import pytest
import torch
from pydantic import ValidationError

from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import ConfigError, InvalidRequestError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT = [5, 17, 42, 99, 7, 300]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def block_bytes(tiny_model_dir) -> int:
    return ModelConfig.from_dir(tiny_model_dir).kv_bytes_per_token(torch.float32) * BLOCK_SIZE


@pytest.fixture(scope="module")
def make_engine(tiny_model_dir):
    def make(**overrides) -> LLMEngine:
        settings = dict(
            model=str(tiny_model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=NUM_BLOCKS * block_bytes(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=8,
        )
        return LLMEngine(**{**settings, **overrides})

    return make


@pytest.fixture(scope="module")
def engine(make_engine) -> LLMEngine:
    """One engine shared by the whole module: it must survive every bad input thrown at it."""
    return make_engine()


@pytest.fixture(scope="module")
def expected_tokens(make_engine, drive) -> list[int]:
    """What a well-formed request yields on an engine that never saw bad input."""
    return drive(make_engine(), [PROMPT], GREEDY)[0].outputs[0].token_ids


@pytest.fixture
def serves(engine, drive, expected_tokens):
    """Call after a bad input: the engine is idle, leak-free and still answers correctly."""

    def check(target: LLMEngine = engine) -> None:
        assert_idle_and_leak_free(target)
        (output,) = drive(target, [PROMPT], GREEDY)
        assert output.finished and output.outputs[0].finish_reason == "length"
        assert output.outputs[0].token_ids == expected_tokens
        assert_idle_and_leak_free(target)

    return check


def assert_idle_and_leak_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    assert engine.requests == {} and engine.outputs.detokenizers == {}


def assert_names_field(error: ValidationError, field: str) -> None:
    assert field in str(error), f"message does not name {field!r}: {error}"
    assert any(field in map(str, e["loc"]) for e in error.errors())


# ---- prompts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[], ""], ids=["no-token-ids", "empty-string"])
def test_empty_prompt(engine, serves, prompt):
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty") as info:
        engine.add_request("empty", prompt, GREEDY)
    assert info.value.field == "prompt"
    serves()


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 10 * MAX_MODEL_LEN])
def test_prompt_that_leaves_no_room_to_generate(engine, serves, length):
    # a prompt of exactly max_model_len tokens is rejected too: the first generated token would not fit
    with pytest.raises(InvalidRequestError, match=f"is {length} tokens; max_model_len is {MAX_MODEL_LEN}") as info:
        engine.add_request("long", [7] * length, GREEDY)
    assert info.value.field == "prompt"
    serves()


def test_longest_allowed_prompt_generates_one_token(engine, serves, drive):
    (output,) = drive(engine, [[7] * (MAX_MODEL_LEN - 1)], SamplingParams(max_tokens=1, temperature=0))
    assert len(output.outputs[0].token_ids) == 1
    assert output.outputs[0].finish_reason == "length"
    serves()


def test_max_tokens_beyond_the_room_left_is_refused_with_the_numbers(engine, serves):
    prompt = [7] * (MAX_MODEL_LEN - 4)
    with pytest.raises(InvalidRequestError, match=f"is 10, but max_model_len is {MAX_MODEL_LEN} and the prompt "
                                                  f"takes {MAX_MODEL_LEN - 4} tokens of it: at most 4") as info:
        engine.add_request("too-long", prompt, SamplingParams(max_tokens=10, temperature=0))
    assert info.value.field == "max_tokens"
    serves()


def test_no_max_tokens_means_as_many_as_the_room_left_and_min_tokens_must_fit_in_it(engine, serves):
    """The one place a missing max_tokens is resolved (the router and the replicas pass None through)."""
    prompt = [7] * (MAX_MODEL_LEN - 4)
    request = engine.make_request("rest", prompt, SamplingParams(max_tokens=None, temperature=0))
    assert request.sampling_params.max_tokens == 4
    with pytest.raises(InvalidRequestError, match="is 5, but max_model_len is") as info:
        engine.make_request("too-many", prompt, SamplingParams(max_tokens=None, min_tokens=5))
    assert info.value.field == "min_tokens"
    serves()


@pytest.mark.parametrize("bad_id", [512, 10_000, -1])
def test_token_id_outside_vocab(engine, serves, bad_id):
    with pytest.raises(InvalidRequestError, match=f"token id {bad_id} outside the vocabulary") as info:
        engine.add_request("oov", [5, 6, bad_id, 7], GREEDY)
    assert info.value.field == "prompt"
    assert "511" in str(info.value), "the message gives the valid range"
    serves()


@pytest.mark.parametrize("bad_id", [3.5, "w3", None])
def test_token_id_that_is_not_an_integer(engine, serves, bad_id):
    with pytest.raises(InvalidRequestError, match="prompt: token ids must be integers"):
        engine.add_request("not-int", [5, bad_id], GREEDY)
    serves()


# ---- sampling parameters ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("logprobs", 21),
        ("n", 2),
        ("stop", [""]),
        ("seed", 2**64),
    ],
)
def test_invalid_sampling_value_names_the_field(engine, serves, field, value):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert_names_field(info.value, field)
    serves()


def test_unknown_sampling_key_is_named(engine, serves):
    with pytest.raises(ValidationError) as info:
        SamplingParams(max_tokens=4, frequency_penality=0.5)  # misspelled on purpose
    assert_names_field(info.value, "frequency_penality")
    assert "Extra inputs are not permitted" in str(info.value)
    serves()


# ---- engine configuration --------------------------------------------------------------------
def test_unknown_config_key_is_named(tiny_model_dir):
    with pytest.raises(ValidationError) as info:
        EngineConfig(model=str(tiny_model_dir), max_num_seq=8)  # misspelled on purpose
    assert_names_field(info.value, "max_num_seq")
    with pytest.raises(ValidationError) as info:
        LLMEngine(dtype="float32", model=str(tiny_model_dir), max_num_seq=8)
    assert_names_field(info.value, "max_num_seq")


def test_overrides_apply_on_top_of_a_config(tiny_model_dir, make_engine):
    base = EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_memory_bytes=1 << 20)
    engine = LLMEngine(base, max_model_len=32, block_size=8)
    assert (engine.max_model_len, engine.block_size) == (32, 8)
    with pytest.raises(ValidationError) as info:
        LLMEngine(base, max_num_seq=8)  # not silently dropped because a config was given
    assert_names_field(info.value, "max_num_seq")


@pytest.mark.parametrize("block_size", [12, 3, 0, 2048])
def test_block_size_must_be_a_power_of_two_in_range(block_size):
    with pytest.raises(ValidationError) as info:
        EngineConfig(block_size=block_size)
    assert_names_field(info.value, "block_size")
    if block_size in (12, 3):
        assert "power of two" in str(info.value)


def test_kv_budget_too_small_for_one_max_length_request(tiny_model_dir, make_engine, serves):
    # one block short of a max-length request
    budget = (MAX_MODEL_LEN // BLOCK_SIZE - 1) * block_bytes(tiny_model_dir)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes") as info:
        make_engine(kv_cache_memory_bytes=budget)
    assert info.value.key == "kv_cache_memory_bytes"
    assert "max_model_len" in str(info.value), "the message says what to change"
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        make_engine(kv_cache_memory_bytes=100)  # less than one block
    with pytest.raises(ValidationError) as error:
        make_engine(kv_cache_memory_bytes=0)
    assert_names_field(error.value, "kv_cache_memory_bytes")
    # exactly enough is fine
    serves(make_engine(kv_cache_memory_bytes=(MAX_MODEL_LEN // BLOCK_SIZE) * block_bytes(tiny_model_dir)))


def test_no_chunked_prefill_needs_a_batch_that_fits_a_max_length_prompt(make_engine, serves):
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        make_engine(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN - 1)
    assert info.value.key == "max_num_batched_tokens"
    assert "max_model_len" in str(info.value)
    serves(make_engine(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN))


def test_batch_budget_below_max_num_seqs(make_engine):
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        make_engine(max_num_seqs=16, max_num_batched_tokens=8)
    assert info.value.key == "max_num_batched_tokens"


# ---- request ids -----------------------------------------------------------------------------
def test_duplicate_request_id_is_rejected_and_the_original_runs_on(engine, serves, expected_tokens):
    engine.add_request("dup", PROMPT, GREEDY)
    engine.step()
    with pytest.raises(InvalidRequestError, match="request_id: 'dup' is already running") as info:
        engine.add_request("dup", [9, 9, 9], SamplingParams(max_tokens=2))
    assert info.value.field == "request_id"
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["dup"]
    assert finished[0].prompt_token_ids == PROMPT
    assert finished[0].outputs[0].token_ids == expected_tokens
    serves()
    # once finished, the id is free again
    engine.add_request("dup", PROMPT, GREEDY)
    while engine.has_unfinished():
        engine.step()
    serves()


def test_abort_of_an_unknown_id_returns_none(engine, serves):
    assert engine.abort("never-added") is None
    engine.add_request("done", PROMPT, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    assert engine.abort("done") is None, "a finished request cannot be aborted"
    serves()


# ---- aborts free everything ------------------------------------------------------------------
def assert_aborted(output, request_id: str) -> None:
    assert output is not None and output.request_id == request_id
    assert output.finished
    assert output.outputs[0].finish_reason == "abort"


def test_abort_of_a_waiting_request(make_engine, serves):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("running", PROMPT, GREEDY)
    engine.add_request("waiting", [11, 12, 13, 14, 15], GREEDY)
    engine.step()
    assert (engine.stats().num_running, engine.stats().num_waiting) == (1, 1)
    assert_aborted(engine.abort("waiting"), "waiting")
    assert engine.stats().num_waiting == 0
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["running"], "the aborted request never runs"
    serves(engine)


def test_abort_mid_prefill_frees_its_blocks(make_engine, serves):
    engine = make_engine(max_num_batched_tokens=8)  # a 40-token prompt takes 5 chunked steps
    request = engine.add_request("long", list(range(100, 140)), GREEDY)
    engine.step()
    engine.step()
    assert request.num_computed_tokens == 16 < request.num_prompt_tokens
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    output = engine.abort("long")
    assert_aborted(output, "long")
    assert output.outputs[0].token_ids == []
    serves(engine)


def test_abort_while_decoding_frees_its_blocks(engine, serves):
    engine.add_request("decoding", PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("neighbour", [8, 9, 10], GREEDY)
    for _ in range(4):
        engine.step()
    assert len(engine.requests["decoding"].output_token_ids) == 4
    output = engine.abort("decoding")
    assert_aborted(output, "decoding")
    assert len(output.outputs[0].token_ids) == 4
    assert engine.abort("decoding") is None, "aborting twice is harmless"
    while engine.has_unfinished():
        engine.step()
    serves()


def test_abort_of_a_preempted_request(tiny_model_dir, make_engine, serves):
    # room for exactly one max-length request: two long ones force a preemption
    engine = make_engine(kv_cache_memory_bytes=(MAX_MODEL_LEN // BLOCK_SIZE) * block_bytes(tiny_model_dir))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("first", list(range(200, 230)), params)
    engine.add_request("second", list(range(300, 330)), params)
    for _ in range(100):
        engine.step()
        if engine.stats().num_preemptions:
            break
    assert engine.stats().num_preemptions == 1
    (victim,) = [r for r in engine.requests.values() if r.num_preemptions]
    assert_aborted(engine.abort(victim.request_id), victim.request_id)
    while engine.has_unfinished():
        engine.step()
    serves(engine)
