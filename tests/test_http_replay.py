"""The benchmark's HTTP client: it times every streamed chunk, honours arrival offsets, and fails loudly.

The server here is a small aiohttp app speaking the OpenAI streaming format (what `kvloom serve`, `vllm serve` and
`llama-server` all answer), so the client's parsing and timing are checked without starting a model.
"""

import asyncio
import json

import pytest
from aiohttp import ClientResponseError, web

from kvloom.benchmarks.http_replay import replay_http
from kvloom.benchmarks.workloads import Workload, WorkloadRequest


def sse(text: str, finish_reason: str | None = None) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "bad":
        return web.json_response({"error": {"message": "prompt: bad", "param": "prompt"}}, status=400)
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if body["prompt"] == "fails midway":
        await response.write(sse(" one"))
        await response.write(b'data: {"error": {"message": "replica died", "param": null}}\n\n')
    else:
        await response.write(sse(""))  # a role-only or empty first chunk is no token
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.01)
            await response.write(sse(f" w{i}", "length" if i == body["max_tokens"] - 1 else None))
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def base():
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_every_streamed_chunk_is_timed_and_arrivals_are_honoured(base):
    workload = Workload("w", [WorkloadRequest("a", [1, 2, 3], 4), WorkloadRequest("b", "hello", 2, arrival_s=0.2)])
    records, wall = await replay_http(base, workload)
    a, b = records
    assert [r.request_id for r in records] == ["a", "b"]
    assert len(a.token_times) == 4 and len(b.token_times) == 2  # the empty first chunk is not a token
    assert a.num_prompt_tokens == 3 and a.num_output_tokens == 4
    assert a.token_times == sorted(a.token_times) and a.first_token == a.token_times[0] <= a.finished
    assert b.arrival - a.arrival >= 0.19
    assert wall == pytest.approx(max(a.finished, b.finished) - a.arrival)


async def test_an_error_status_or_an_error_chunk_fails_the_replay(base):
    with pytest.raises(ClientResponseError, match="400"):
        await replay_http(base, Workload("w", [WorkloadRequest("x", "bad", 2)]))
    with pytest.raises(RuntimeError, match="y: replica died"):
        await replay_http(base, Workload("w", [WorkloadRequest("y", "fails midway", 2)]))
