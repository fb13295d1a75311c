"""Structured outputs: whatever the model would rather say, the output parses against the constraint:
a JSON schema, any JSON object, a regular expression or a choice, greedy and sampled, in a batch beside
unconstrained requests, through preemption and aborts. A constraint xgrammar cannot use is a clear error
naming the request field that carried it."""

import json
import re

import jsonschema
import pytest
import torch

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams, StructuredOutputs
from kvloom.engine.structured_output import mask_disallowed

# Bounded (string lengths, integer ranges, array sizes): a 135M model left free will write digits or
# characters until max_tokens, and an output cut short by max_tokens cannot parse, constrained or not.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "population", "capital"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 3},
                                      "mood": {"enum": ["happy", "sad", "calm"]}},
     "required": ["tags", "mood"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -999, "maximum": 999}, "minItems": 2, "maxItems": 4},
]
PROMPTS = [
    [{"role": "user", "content": "Describe a person as JSON."}],
    [{"role": "user", "content": "Tell me about Paris."}],
    [{"role": "user", "content": "How do you feel today? Answer with tags."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_TOKENS = 96  # room for every schema above to close
OBJECT_MAX_TOKENS = 128  # a free-form JSON object has no bound: 9 of seeds 0-11 closed within 256 tokens, seed 0 in 50


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(model="smollm2", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple[str, str]]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].text, out.outputs[0].finish_reason)
    return done


def chat(engine: LLMEngine, messages: list[dict]) -> list[int]:
    return engine.apply_chat_template(messages)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_parses_in_one_batch_greedy_and_sampled(engine, temperature):
    prompts = [chat(engine, m) for m in PROMPTS for _ in range(2)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                             structured_outputs=StructuredOutputs(json_schema=schema))
              for schema in SCHEMAS for seed in (1, 2)]
    done = run(engine, prompts, params)
    for i, (schema, _) in enumerate((s, seed) for s in SCHEMAS for seed in (1, 2)):
        text, reason = done[f"r{i}"]
        assert reason == "stop", f"schema {schema} did not close in {MAX_TOKENS} tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_json_object_regex_and_choice_beside_unconstrained_requests(engine):
    prompts = [chat(engine, m) for m in PROMPTS]
    constraints = [StructuredOutputs(json_object=True), StructuredOutputs(regex=r"\d{3}-\d{4}"),
                   StructuredOutputs(choice=["sunny", "rainy", "snowy"]), None]
    done = run(engine, prompts, [SamplingParams(max_tokens=OBJECT_MAX_TOKENS if c and c.json_object else MAX_TOKENS,
                                                temperature=0.8, seed=0, structured_outputs=c) for c in constraints])
    assert isinstance(json.loads(done["r0"][0]), dict)
    assert re.fullmatch(r"\d{3}-\d{4}", done["r1"][0])
    assert done["r2"][0] in ("sunny", "rainy", "snowy")
    assert done["r3"][1] in ("stop", "length") and not done["r3"][0].startswith(("sunny", "rainy", "snowy"))


def test_the_mask_touches_only_constrained_rows_and_only_disallowed_tokens(engine):
    choice = engine.grammars.matcher(StructuredOutputs(choice=["yes", "no"]))
    allowed = {engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    logits = torch.randn(3, engine.vocab_size, dtype=torch.bfloat16)
    before = logits.clone()
    mask_disallowed(logits, [choice], [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert allowed <= kept and len(kept) < 50, "the first token of a choice, a handful of ways to spell it"
    assert torch.equal(logits[1][list(kept)], before[1][list(kept)])


def test_greedy_constrained_output_is_the_unconstrained_one_when_that_already_fits(engine):
    """The mask only removes tokens: where the model's own greedy choice is allowed, it is kept."""
    prompt = chat(engine, [{"role": "user", "content": "Answer yes or no: is the sky blue?"}])
    free = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0)])["r0"][0]
    constrained = run(engine, [prompt], [SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(
        choice=[free, free + "!"]))])["r0"][0]
    assert constrained.startswith(free)


def test_preempted_and_aborted_constrained_requests_stay_exact():
    """A pool too small for the batch forces preemption by recompute: the grammar keeps its place (float32,
    so that recomputing cannot change a greedy token)."""
    small = LLMEngine(model="smollm2", dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    prompt = chat(small, PROMPTS[0])
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json_schema=SCHEMAS[0]))
    for i in range(6):
        small.add_request(f"r{i}", prompt, params)
    small.add_request("gone", prompt, params)
    small.step()
    small.abort("gone")
    done = {}
    while small.has_unfinished():
        done.update({o.request_id: o.outputs[0].text for o in small.step() if o.finished})
    assert small.stats().num_preemptions > 0
    assert len(set(done.values())) == 1, "greedy outputs agree whether or not a request was preempted"
    jsonschema.validate(json.loads(done["r0"]), SCHEMAS[0])
    assert small.stats().num_free_blocks == small.stats().num_blocks


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputs(json_schema={"type": "objekt"}, field="response_format"), "objekt"),
    (StructuredOutputs(regex="(unclosed", field="guided_regex"), "parenthesis"),
])
def test_a_constraint_xgrammar_cannot_use_is_an_error_naming_its_field(engine, constraint, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.make_request("bad", [1, 2, 3], SamplingParams(structured_outputs=constraint))
    assert info.value.field == constraint.field


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
