"""Tool calling over real HTTP to a real Serve deployment of SmolLM2 (whose template takes no tools: the Hermes
form), with real clients (`openai`, langchain-openai; the openai-agents SDK in test_responses_api.py): every call returned parses and validates
against its tool's schema, in every mode, streamed or not, and greedy output equals the offline `LLM.chat` given the
same tools (float32: both are exact). The formats on their own: test_tool_formats.py."""

import json

import httpx
import jsonschema
import openai
import pytest

from kvloom.cluster.config import ClusterConfig
from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32"}
SHARED_APP = "smollm2"  # the app these modules serve is one: conftest.deploy starts it once for them all
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}, "auto": "auto",
           "none": "none"}


@pytest.fixture(scope="module")
def base(ray_serve, deploy_app) -> str:
    deploy_app(ClusterConfig.model_validate({"engine": ENGINE, "num_replicas": 1}))
    return ray_serve


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM("smollm2", **ENGINE)


def offline(llm: LLM, messages: list[dict], choice, max_tokens: int = 64) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return llm.chat(messages, params, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)[0].outputs[0].text


def assert_valid(calls) -> None:
    """Each call names a tool and its arguments are JSON valid against that tool's parameters."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("mode", CHOICES)
def test_each_tool_choice_returns_what_the_offline_llm_chat_generates_and_every_call_validates(client, llm, mode):
    got = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=CHOICES[mode],
                                         parallel_tool_calls=False, max_tokens=64, temperature=0).choices[0]
    want_content, want_calls = llm.tool_format.parse(offline(llm, ASK, CHOICES[mode]))
    calls = got.message.tool_calls or []
    assert got.message.content == want_content
    assert [(c.function.name, c.function.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
    assert_valid(calls)
    if mode in ("required", "named"):
        assert got.finish_reason == "tool_calls" and len(calls) == 1 and got.message.content is None
        assert mode != "named" or calls[0].function.name == "add"
    if mode == "none":
        assert not calls


def test_a_streamed_call_comes_as_openais_deltas_that_reassemble_into_the_unstreamed_call(client):
    asked = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0,
                 parallel_tool_calls=False)
    whole = client.chat.completions.create(**asked).choices[0]
    name, arguments, content, first_piece, reasons = None, "", "", None, []
    for event in client.chat.completions.create(**asked, stream=True):
        delta = event.choices[0].delta
        content += delta.content or ""
        reasons.append(event.choices[0].finish_reason)
        for piece in delta.tool_calls or ():
            assert piece.index == 0
            if piece.id is not None:
                first_piece = piece
                name = piece.function.name
            arguments += piece.function.arguments or ""
    assert first_piece.type == "function" and first_piece.id.startswith("call_")
    assert (name, arguments) == (whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)
    assert content == "" and reasons[-1] == "tool_calls"  # no markup leaks into content


def test_a_history_with_an_assistants_tool_calls_and_a_tool_result_goes_on_as_offline(client, llm):
    messages = [{"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    got = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="auto",
                                         parallel_tool_calls=False, max_tokens=40, temperature=0).choices[0]
    want_content, want_calls = llm.tool_format.parse(offline(llm, messages, "auto", 40))
    assert got.message.content == want_content
    assert [c.function.name for c in got.message.tool_calls or ()] == [c.name for c in want_calls]


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
], ids=["parameters-not-a-schema", "named-not-in-tools", "unknown-choice", "with-response-format",
        "tool-message-without-call-id", "null-user-content"])
def test_bad_tool_input_is_a_400_naming_the_field(base, body, field):
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={"model": "smollm2", "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field), response.json()
    assert httpx.post(f"{base}/v1/chat/completions", timeout=60, json={  # the replica serves on
        "model": "smollm2", "messages": ASK, "max_tokens": 2}).status_code == 200


def test_langchain_openais_bind_tools_gets_its_call(base):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="smollm2", base_url=f"{base}/v1", api_key="unused", temperature=0, max_tokens=64)
    message = chat.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
