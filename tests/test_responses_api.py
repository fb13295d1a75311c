"""OpenAI's Responses API over real HTTP to a real Serve deployment of SmolLM2, with two tenants, driven by the
`openai` client and the openai-agents SDK (through chat completions and through this API): a response says what the same chat completion says, streamed as
OpenAI's events; tool calls become function_call items whose outputs continue the conversation under
`previous_response_id`; stored responses belong to their tenant and outlive the router; background responses are
polled and cancelled; bad input is a 4xx naming the field."""

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

from kvloom.cluster.config import ClusterConfig

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32"}
TENANTS = [{"name": "alice", "api_keys": ["sk-alice"]}, {"name": "bob", "api_keys": ["sk-bob"]}]
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


@pytest.fixture(scope="module")
def base(ray_serve, deploy_app) -> str:
    deploy_app(ClusterConfig.model_validate({"engine": ENGINE, "num_replicas": 1, "tenants": TENANTS}))
    return ray_serve


def client(base: str, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=120, max_retries=0)


def test_a_response_says_what_the_same_chat_completion_says(base):
    chat = client(base).chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": "Name a primary colour."}], max_tokens=20, temperature=0)
    response = client(base).responses.create(model="smollm2", instructions="Answer briefly.",
                                             input="Name a primary colour.", max_output_tokens=20, temperature=0)
    assert response.status == "completed" and response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)


def test_a_streamed_response_is_openais_event_sequence_and_its_deltas_make_the_text(base):
    asked = dict(model="smollm2", input="Name a primary colour.", max_output_tokens=20, temperature=0)
    whole = client(base).responses.create(**asked)
    events = list(client(base).responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_a_function_call_and_its_output_continue_under_previous_response_id_and_stay_with_their_tenant(base):
    alice = client(base)
    first = alice.responses.create(model="smollm2", input="What is 2 plus 3?", tools=[ADD], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=48, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    second = alice.responses.create(model="smollm2", previous_response_id=first.id, tools=[ADD], temperature=0,
                                    max_output_tokens=24, input=[{"type": "function_call_output",
                                                                  "call_id": call.call_id, "output": "5"}])
    assert second.status == "completed" and second.previous_response_id == first.id
    assert alice.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):  # another tenant's id is unknown to bob: no content leaks
        client(base, "sk-bob").responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as refused:
        client(base, "sk-bob").responses.create(model="smollm2", previous_response_id=first.id, input="go on")
    assert refused.value.body["param"] == "previous_response_id"
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


@pytest.mark.parametrize("body, status, field", [
    ({"previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, 400, "tools.0.parameters"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "missing"}}, 400, "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, 400, "input"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"background": True, "stream": True}, 400, "background"),
    ({"background": True, "store": False}, 400, "background"),
], ids=["unknown-previous", "parameters-not-a-schema", "named-not-in-tools", "output-without-call-id", "zero-tokens",
        "background-streamed", "background-unstored"])
def test_bad_input_is_a_4xx_naming_the_field(base, body, status, field):
    response = httpx.post(f"{base}/v1/responses", timeout=60, headers={"Authorization": "Bearer sk-alice"},
                          json={"model": "smollm2", "input": "hi", "max_output_tokens": 4, **body})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"].startswith(field), response.json()
    if field == "input":
        assert "item 0.call_id" in response.json()["error"]["message"]


def poll(alice: openai.OpenAI, response_id: str, until: set[str], timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (response := alice.responses.retrieve(response_id)).status not in until:
        assert time.monotonic() < deadline, response
        time.sleep(0.1)
    return response


def running(base: str) -> float:
    metrics = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-alice"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("kvloom:num_requests_running{"))


def test_a_background_response_is_answered_at_once_and_polled_to_what_a_whole_one_says(base):
    alice, asked = client(base), dict(model="smollm2", input="Name a primary colour.", max_output_tokens=20,
                                      temperature=0)
    queued = alice.responses.create(**asked, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background and not queued.output
    done = poll(alice, queued.id, {"completed", "failed"})
    assert done.status == "completed" and done.output_text == alice.responses.create(**asked).output_text
    follow = alice.responses.create(model="smollm2", input="And another?", previous_response_id=done.id,
                                    max_output_tokens=4)
    assert follow.status == "completed"


def test_cancel_stops_a_background_response_and_its_request_on_the_replica(base):
    alice = client(base)
    queued = alice.responses.create(model="smollm2", input="Write a long essay on the history of Rome.",
                                    max_output_tokens=1500, temperature=0, background=True)
    cancelled = alice.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and alice.responses.retrieve(queued.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while running(base):  # the replica's request was aborted (its stats arrive a moment later)
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.1)
    assert alice.responses.cancel(queued.id).status == "cancelled"  # again: as it is
    with pytest.raises(openai.NotFoundError):
        client(base, "sk-bob").responses.cancel(queued.id)
    whole = alice.responses.create(model="smollm2", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        alice.responses.cancel(whole.id)


@pytest.mark.parametrize("api", ["chat completions", "responses"])
def test_the_openai_agents_sdk_runs_a_tool_loop_to_a_final_answer(base, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    model = kind("smollm2", openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-alice"))
    agent = Agent(name="calculator", instructions="Use the add tool, then answer.", tools=[add], model=model,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
    result = asyncio.run(Runner.run(agent, "What is 2 plus 3?", max_turns=4))
    assert calls and all(isinstance(a, int) and isinstance(b, int) for a, b in calls)
    assert isinstance(result.final_output, str) and result.final_output  # the tool loop reached an answer


def test_stored_responses_outlive_a_killed_router_and_one_it_was_generating_ends_failed(base, router_killer):
    alice = client(base)
    kept = alice.responses.create(model="smollm2", input="Name a primary colour.", max_output_tokens=8)
    unfinished = alice.responses.create(model="smollm2", input="Write a long essay on the history of Rome.",
                                        max_output_tokens=1500, background=True)

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-alice"}).status_code == 200
        except httpx.HTTPError:
            return False

    router_killer(ready)
    assert alice.responses.retrieve(kept.id).output_text == kept.output_text
    assert alice.responses.retrieve(unfinished.id).status == "failed"
    follow = alice.responses.create(model="smollm2", input="Another?", previous_response_id=kept.id,
                                    max_output_tokens=4)
    assert follow.status == "completed"
