"""Each tool-call format (vLLM's parser names: hermes, llama3_json, mistral, pythonic) on its own: its grammar
takes the calls it writes and refuses arguments its tools' schemas refuse, its parser gives the same content and
calls however a stream is split, the template tells which one a model speaks, and an engine set to it generates
calls that parse and validate in every mode."""

import json
import random

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.tool_calls.formats import FORMATS, tool_format
from kvloom.engine.tool_calls.pythonic_grammar import arguments_grammar
from kvloom.engine.tool_calls.tools import ToolCall, parse_tool_choice, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                     "days": {"type": "integer"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [ToolCall(id="1", function={"name": "get_weather", "arguments": '{"city": "Pa\\"ris [x]", "unit": "c"}'}),
         ToolCall(id="2", function={"name": "add", "arguments": '{"a": 1, "b": -2}'})]
BAD = ToolCall(id="3", function={"name": "add", "arguments": '{"a": "one", "b": 2}'})
MODES = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}, "auto": "auto"}


def use_of(fmt, choice="required", parallel=True):
    return fmt.tool_use(parse_tools(TOOLS), parse_tool_choice(choice), parallel)


def grammar(fmt, choice="required", parallel=True) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_structural_tag(json.dumps(fmt.structural_tag(use_of(fmt, choice, parallel))))


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_the_grammar_takes_the_formats_own_calls_and_refuses_arguments_off_their_schema(fmt):
    assert accepts(grammar(fmt), fmt.calls_text(CALLS))
    assert accepts(grammar(fmt, parallel=False), fmt.calls_text(CALLS[:1]))
    assert not accepts(grammar(fmt, parallel=False), fmt.calls_text(CALLS))
    assert not accepts(grammar(fmt), fmt.calls_text([BAD]))
    assert not accepts(grammar(fmt), "Sure, here you go.")  # required: calls only
    assert accepts(grammar(fmt, MODES["named"]), fmt.calls_text(CALLS[1:]))
    assert not accepts(grammar(fmt, MODES["named"]), fmt.calls_text(CALLS[:1]))
    assert accepts(grammar(fmt, "auto"), "It is sunny [1]. " + fmt.calls_text(CALLS))
    assert accepts(grammar(fmt, "auto"), "Plain prose, no call.")
    assert not accepts(grammar(fmt, "auto"), "Let me see. " + fmt.calls_text([BAD]))


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_any_split_of_a_streamed_output_gives_the_same_content_and_calls(fmt):
    text = "Let me check.\n" + fmt.calls_text(CALLS)
    rng = random.Random(0)
    for _ in range(100):
        stream, pieces, at = fmt.stream(), [], 0
        while at < len(text):
            step = rng.randint(1, 12)
            pieces += stream.feed(text[at:at + step])
            at += step
        pieces += stream.finish()
        assert "".join(p.content for p in pieces) == "Let me check.\n"
        assert [p.name for p in pieces if p.name] == ["get_weather", "add"]
        assert [json.loads("".join(p.arguments for p in pieces if p.call_index == i)) for i in (0, 1)] == [
            json.loads(c.function.arguments) for c in CALLS]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_a_call_cut_short_is_not_a_call_and_prose_is_content(fmt):
    written = fmt.calls_text(CALLS[:1])
    assert fmt.parse("Hi " + written[:-3]) == ("Hi", [])
    assert fmt.parse("The list [a, b] and {x} stay prose.") == ("The list [a, b] and {x} stay prose.", [])


@pytest.mark.parametrize("template, expected", [
    ("{{ '<tool_call>\\n' }}{{ tools }}", "hermes"),  # Qwen 2.5, Hermes
    ('{%- if tools %}{"name": function name, "parameters": dictionary of argument name}{% endif %}ipython',
     "llama3_json"),  # Llama 3.1 / 3.2
    ("{{- '[TOOL_CALLS][' }}{{ tools }}", "mistral"),
    ("you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...)]",
     "pythonic"),  # Llama 3.2 pythonic, Llama 4
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # takes no tools: the fallback
    (None, "hermes"),
])
def test_auto_reads_the_format_from_the_chat_template(template, expected):
    assert tool_format("auto", template).name == expected
    assert tool_format("pythonic", template).name == "pythonic"  # a parser set in the config wins


def test_pythonic_refuses_tools_whose_names_python_cannot_call():
    bad = {"type": "function", "function": {"name": "get-weather"}}
    with pytest.raises(InvalidRequestError, match="tools.0.function"):
        FORMATS["pythonic"].tool_use(parse_tools([bad]), "auto", True)


def test_pythonic_arguments_grammar_keeps_types_enums_and_required_properties():
    schema = {"type": "object", "required": ["city"], "$defs": {"P": {"type": "object", "required": ["lat"],
                                                                       "properties": {"lat": {"type": "number"}}}},
              "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "at": {"$ref": "#/$defs/P"},
                             "tags": {"type": "array", "items": {"type": "string"}}, "x": {"type": ["integer", "null"]}}}
    compiled = xgrammar.Grammar.from_ebnf(arguments_grammar(schema))
    for good in ['city="a"', 'city="a", unit="f", x=None', 'city="a", at={"lat": -1.5e3}', 'city="a", tags=["b"]']:
        assert accepts(compiled, good), good
    for bad in ['unit="c"', 'city="a", unit="k"', 'city=1', 'city="a", x=1.5', 'city="a", at={}']:
        assert not accepts(compiled, bad), bad


def test_mistral_call_ids_are_nine_letters_or_digits_as_its_templates_require():
    assert all(len(i) == 9 and i.isalnum() for i in (FORMATS["mistral"].new_call_id() for _ in range(20)))


@pytest.fixture(scope="module")
def llms(smollm2_dir):
    """SmolLM2 (its template takes no tools: each format reaches it through the fallback), once per format."""
    return {name: LLM("smollm2", tool_call_parser=name, dtype="float32", max_model_len=2048, max_num_seqs=8,
                      kv_cache_memory_bytes=128 << 20) for name in FORMATS}


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_an_engine_set_to_a_format_writes_calls_that_parse_and_validate_in_every_mode(llms, name):
    llm = llms[name]
    assert llm.tool_format.name == name
    ask = [{"role": "user", "content": "What is the weather in Paris, and what is 2 plus 3?"}]
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in CALLS]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}, {"role": "tool", "tool_call_id": "2",
                                                                           "content": "5"}]
    for mode, choice in MODES.items():
        for output in llm.chat([ask, history], SamplingParams(max_tokens=48, temperature=0), tools=TOOLS,
                               tool_choice=choice, parallel_tool_calls=False):  # one call: then the grammar ends
            content, calls = llm.tool_format.parse(output.outputs[0].text)
            assert calls or mode == "auto", (mode, output.outputs[0].text)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert mode != "named" or [c.name for c in calls] == ["add"]
