"""Hostile clients over real HTTP: bodies generated from the request models' own JSON schemas, every field at any
depth either valid or any JSON value at all, never get a 5xx, never restart the replica and never leak a KV block;
and a fresh unknown field name in every request grows neither the router's memory nor its log."""

import asyncio
import json
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

from kvloom.benchmarks.hostile_bodies import ENDPOINTS, hostile
from kvloom.cluster.config import ClusterConfig
from kvloom.router.openai_responses.request import ResponsesRequest
from kvloom.router.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from kvloom.router.unknown_fields import MAX_NAMES, UnknownFieldLog

pytestmark = pytest.mark.slow
EXAMPLES = 25  # bodies per endpoint over HTTP in CI (the parsing alone takes PARSED); benchmarks/fuzz.py sends 20,000
PARSED = 1500


@pytest.mark.parametrize("model", list(ENDPOINTS.values()), ids=lambda model: model.__name__)
def test_every_generated_body_is_parsed_or_refused_naming_a_field(model):
    """The router's parsing (what `Router._parse` and `_job` call) raises nothing but the two errors it answers with
    a 400 naming the field: thousands of bodies here, a few dozen more through the live server below."""

    @settings(max_examples=PARSED, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=hostile(model, "tiny"))
    def parse(body):
        try:
            request = model.model_validate(body)
            request.check_supported()
            if isinstance(request, ResponsesRequest):  # it runs as its chat request
                request = ChatCompletionRequest.model_validate(request.chat_body(request.conversation([])))
                request.check_supported()
        except (ValidationError, UnsupportedFieldError):
            return
        if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
            try:
                request.sampling_params(2, None)
            except ValidationError:
                return

    parse()


@pytest.fixture(scope="module")
def server(ray_serve, deploy_app, tmp_path_factory, build_tiny_model):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-chat"), chat=True)
    router = deploy_app(ClusterConfig.model_validate({
        "served_model_name": "tiny", "num_replicas": 1,
        "engine": {"model": str(model), "dtype": "float32", "kv_cache_memory_bytes": 16 << 20,
                   "max_model_len": 256, "max_num_seqs": 8}}))
    return ray_serve, router


def replicas(router) -> dict[str, dict]:
    return {s["replica_id"]: s for s in router.replica_stats.remote().result()}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_no_generated_body_gets_a_5xx_or_restarts_the_replica(server, path):
    base, router = server
    before = replicas(router)
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(body=hostile(ENDPOINTS[path], "tiny"))
    def send(body):
        with httpx.Client(timeout=60) as client:
            response = client.post(f"{base}{path}", content=json.dumps(body))
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (body, response.text)
        assert "internal_server_error" not in response.text, (body, response.text)

    send()
    assert set(seen) <= {200, 400, 404, 413, 422} and seen.get(400), seen
    assert replicas(router).keys() == before.keys()  # the same replica, never restarted
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200


def test_the_named_fuzz_finds_are_400s_naming_their_field(server):
    base, _ = server
    for body, param in [
        ({"response_format": {"type": "json_schema", "json_schema": [1, {}]}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": "schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": 7}}, "response_format.json_schema"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ]:
        response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text


def test_10000_fresh_unknown_field_names_keep_a_bounded_set_and_log(caplog):
    log = UnknownFieldLog()
    with caplog.at_level("WARNING", logger="kvloom.router.unknown_fields"):
        for i in range(10_000):
            log.note([f"x-{i}", "metadata", "y" * 100_000])
    assert len(log.names) == MAX_NAMES and max(map(len, log.names)) <= 64
    assert log.lines == len(caplog.records) == MAX_NAMES + 1  # one per name kept, one saying the rest are not
    assert log.unlogged == 10_000 + 2 - MAX_NAMES


async def test_a_fresh_unknown_field_in_every_request_grows_neither_the_router_nor_its_log(server):
    """Over HTTP, past the cap (the 10,000 of the issue run in-process above, and in benchmarks/fuzz.py)."""
    base, router = server
    sent = 4 * MAX_NAMES

    async def send(client: httpx.AsyncClient, count: int) -> None:
        for _ in range(count):
            response = await client.post(f"{base}/tokenize", json={"prompt": "w3 w4", f"x-{uuid.uuid4().hex}": 1})
            assert response.status_code == 200, response.text

    start = await router.held_state.remote()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=8)) as client:
        await asyncio.gather(*(send(client, sent // 8) for _ in range(8)))
    held = await router.held_state.remote()
    assert held["unknown_field_names"] == MAX_NAMES
    assert held["unknown_field_log_lines"] <= start["unknown_field_log_lines"] + MAX_NAMES + 1
    assert held["unknown_field_names_unlogged"] >= sent - MAX_NAMES
    assert held["awaiting_first_token"] == held["channel_requests"] == held["queued"] == 0
