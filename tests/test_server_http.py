"""The OpenAI-compatible server on a real local Ray cluster, spoken to over real HTTP on loopback."""

import time

import httpx
import openai
import pytest

from kvloom.cluster.config import ClusterConfig
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32"}
SHARED_APP = "smollm2"  # the app these modules serve is one: conftest.deploy starts it once for them all
PROMPT = "The three most useful kitchen tools are"
QUESTION = [{"role": "user", "content": "Give me two tips for writing clear emails."}]


@pytest.fixture(scope="module")
def server(ray_serve, deploy_app):
    router = deploy_app(ClusterConfig.model_validate({"engine": ENGINE, "num_replicas": 1}))
    return ray_serve, router


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline(smollm2_dir) -> LLMEngine:
    return LLMEngine(model="smollm2", **ENGINE)


def offline_run(engine: LLMEngine, prompt, max_tokens: int):
    engine.add_request("offline", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished():
        done = [o for o in engine.step() if o.finished]
    return done[0].outputs[0]


def offline_text(engine: LLMEngine, prompt, max_tokens: int) -> str:
    return offline_run(engine, prompt, max_tokens).text


def test_completion_matches_offline_engine(client, offline):
    result = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0)
    expected = offline_run(offline, PROMPT, 24)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.prompt_tokens == len(offline.encode(PROMPT))


def test_streamed_completion_matches_offline_engine(client, offline):
    stream = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == offline_text(offline, PROMPT, 24)


def test_chat_completion_matches_offline_engine(client, offline):
    result = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=32, temperature=0)
    expected = offline_text(offline, offline.apply_chat_template(QUESTION), 32)
    assert result.choices[0].message.content == expected
    assert result.choices[0].message.role == "assistant"


def test_streamed_chat_with_usage_matches_offline_engine(client, offline):
    stream = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline_text(offline, offline.apply_chat_template(QUESTION), 32)
    assert chunks[-1].usage.completion_tokens == len(offline_run(offline, offline.apply_chat_template(QUESTION), 32).token_ids)
    assert not chunks[-1].choices


def test_sse_stream_ends_with_done(server):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_models_and_health(server):
    base = server[0]
    assert httpx.get(f"{base}/health").json()["replicas"] == 1
    assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["smollm2"]


def test_openapi_document_and_docs_page_through_serve(server):
    """Serve's proxy hands out the document with the request bodies (test_openapi.py checks it whole)."""
    base = server[0]
    document = httpx.get(f"{base}/openapi.json", timeout=30).json()
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"messages", "tools"} <= set(document["components"]["schemas"]["ChatCompletionRequest"]["properties"])
    docs = httpx.get(f"{base}/docs", timeout=30)
    assert docs.status_code == 200 and "/openapi.json" in docs.text


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"prompt": "hi"}, 400, "model"),
        ("/v1/completions", {"model": "smollm2"}, 400, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "n": 65}, 400, "n"),
        ("/v1/completions", {"model": "smollm2", "prompt": ["a", "b"], "n": 33}, 400, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
        ("/v1/completions", {"model": "smollm2", "prompt": ["a", "b"], "best_of": 33}, 400, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
        ("/v1/completions", {"model": "smollm2", "prompt": "word " * (ENGINE["max_model_len"] + 76)}, 400, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": "word " * (ENGINE["max_model_len"] - 124),
                             "max_tokens": 500}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "smollm2", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    response = httpx.post(f"{server[0]}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_json_is_400_and_server_keeps_serving(server, client):
    response = httpx.post(f"{server[0]}/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert client.completions.create(model="smollm2", prompt="ok", max_tokens=2).choices[0].finish_reason


def test_deeply_nested_or_oversized_bodies_get_400_and_413(server, client):
    deep = b'{"model": "smollm2", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(f"{server[0]}/v1/completions", content=deep, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    huge = {"model": "smollm2", "prompt": "x" * (5 * 2**20)}  # over the 4 MiB default
    response = httpx.post(f"{server[0]}/v1/completions", json=huge, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert client.completions.create(model="smollm2", prompt="ok", max_tokens=2).choices[0].finish_reason


def test_unknown_endpoints_and_wrong_methods_answer_in_openais_error_shape(server):
    base = server[0]
    unknown = httpx.post(f"{base}/v1/embeddings", json={"model": "smollm2", "input": "hi"}, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "no such endpoint: POST /v1/embeddings", "type": "not_found_error",
                                       "param": None, "code": "unknown_url"}
    wrong = httpx.get(f"{base}/v1/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["allow"]


@pytest.mark.parametrize("n", [1, 4])
def test_disconnect_mid_stream_frees_blocks_within_30s_and_serving_goes_on(server, client, n):
    """Alone this takes ~0.5 s (Serve's proxy sees the disconnect, the router aborts, the next 0.5 s stats push
    shows the blocks free); inside the full suite on 2 cores it measured 2.0-2.1 s, once 5.3 s and once over 10 s
    (its 9 blocks then held ~130 generated tokens: ~80 ms a token on the loaded host). A leak holds the blocks
    for the whole 1,000 tokens: ~40 s alone, ~80 s at that pace. With n choices every one is aborted (closing
    them stopped at the first one that awaited, once), and their aborts, sent together, must not stall Serve's
    routing of every later call (they did, once: see router/handles.py)."""
    base, router = server
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": n}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received >= 3:
                break
    disconnected = time.monotonic()
    while True:
        stats = router.replica_stats.remote().result()[0]
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        assert time.monotonic() - disconnected < 30.0, f"blocks still held: {stats}"
        time.sleep(0.05)
    assert client.with_options(timeout=60).completions.create(model="smollm2", prompt="ok", max_tokens=2).choices


def test_metrics_after_traffic(server, client):
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8)
    time.sleep(1.0)  # replicas push their stats every 0.5 s
    text = httpx.get(f"{server[0]}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)

    def total(prefix):
        return sum(v for k, v in values.items() if k.startswith(prefix))

    assert total("kvloom:generation_tokens_total") >= 8
    assert total("kvloom:prompt_tokens_total") > 0
    assert total("kvloom:time_to_first_token_seconds_count") >= 1
    assert total("kvloom:e2e_request_latency_seconds_count") >= 1
    assert total("kvloom:time_per_output_token_seconds_count") >= 1
    assert total("kvloom:request_queue_time_seconds_count") >= 1
    assert total("kvloom:prefix_cache_queries_total") > 0
    steps = total("kvloom:engine_steps_total")
    assert steps > 0 and total("kvloom:engine_step_requests_total") >= steps
    assert total("kvloom:engine_step_seconds_total") > 0
    for gauge in ("kvloom:num_requests_running", "kvloom:num_requests_waiting", "kvloom:kv_cache_usage_perc"):
        assert any(k.startswith(gauge) for k in values), gauge
    assert 0.0 <= total("kvloom:kv_cache_usage_perc") <= 1.0
