"""kvloom's autoscaling under Serve's own autoscaler, on the tiny model with logical CPUs (2-core hosts add no
compute: what is tested is the decisions, the serving and what happens to requests, not the speed-up).

- a backlog brings more replicas, up to max_replicas, that serve; idleness takes them away;
- a replica Serve removes while 20 streams run on it: every stream completes with the text an uninterrupted
  run gives, on the replica that stays, and no KV block is left held;
- with min_replicas 0 no replica runs while idle, and the first request waits for one and is served.
"""

import asyncio
import json
import time

import httpx
import pytest
from ray import serve

from kvloom.cluster.config import ClusterConfig

pytestmark = pytest.mark.slow


def config(model_dir, max_num_seqs: int, context: int = 1024, **autoscaling) -> ClusterConfig:
    """No slack: requests beyond a replica's slots wait in the router, which is the backlog the policy sees."""
    return ClusterConfig.model_validate({
        "served_model_name": "tiny",
        "engine": {"model": str(model_dir), "dtype": "float32", "kv_cache_memory_bytes": 16 * context << 10,
                   "max_model_len": context, "max_num_seqs": max_num_seqs},
        "router": {"replica_slack": 0},
        "resources": {"num_cpus": 1, "torch_threads": 1},
        "autoscaling": {"target": {"waiting_per_replica": 1}, "upscale_delay_s": 1, "look_back_s": 2, **autoscaling},
    })


@pytest.fixture(autouse=True)
def no_app_before(ray_serve):
    """Each test starts from no app: Serve carries a running deployment's replica count into an autoscaled update of
    it (the new version's first target is the replicas running, not min_replicas), whose extra replica would join and
    leave before any load came."""
    serve.delete("kvloom")


def running_replicas() -> int:
    return serve.status().applications["kvloom"].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def wait_until(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.25)


async def until(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.25)


async def stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """A greedy stream, read to its end: status, text, error events and whether [DONE] came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    got = {"status": None, "text": "", "errors": [], "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        got["status"] = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                got["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                got["errors"] += [event["error"]] if "error" in event else []
                got["text"] += "".join(c["text"] for c in event.get("choices", []))
    return got


async def alone(base: str, prompt: str, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        return await stream_text(client, prompt, max_tokens)


def test_a_backlog_brings_replicas_up_to_the_maximum_that_serve_and_idleness_takes_them_away(
        ray_serve, deploy_app, tiny_model_dir):
    router = deploy_app(config(tiny_model_dir, max_num_seqs=2, min_replicas=1, max_replicas=3,
                               downscale_delay_s=2, graceful_period_s=1))
    assert running_replicas() == 1

    async def load_then_quiet() -> list[dict]:
        body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=ray_serve, timeout=300) as client:
            # a backlog that outlasts the third replica's start however fast the host (the clients walk away then)
            requests = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(64)]

            async def three_serving() -> bool:
                stats = await router.replica_stats.remote()
                return len(stats) == 3 and all(s["dispatched"] > 0 for s in stats)
            try:
                await until(three_serving, "three replicas serving a sustained backlog", 120)
                return await router.replica_stats.remote()
            finally:
                for request in requests:  # the clients walk away: the load is gone
                    request.cancel()
                await asyncio.gather(*requests, return_exceptions=True)

    scaled = asyncio.run(load_then_quiet())
    assert len(scaled) == 3, scaled
    wait_until(lambda: running_replicas() == 1, "the idle replicas taken away", 60)
    wait_until(lambda: len(router.replica_stats.remote().result()) == 1, "the router sees one replica", 10)
    events = router.scaling_events.remote().result()  # what `kvloom status` shows
    grew = [e for e in events if e["joined"] and e["replicas"] > 1]
    assert len(grew) >= 1 and all(e["waiting_per_replica"] > 1 for e in grew), events
    assert sum(len(e["left"]) for e in events) == 2 and events[-1]["replicas"] == 1, events


def test_a_replica_removed_while_20_streams_run_on_it_loses_none_of_them(ray_serve, deploy_app, build_tiny_model,
                                                                          tmp_path):
    """Replica A is filled with 24 long requests (all its slots); 20 greedy streams then wait in the router, so
    Serve adds replica B, which takes them. A's clients walk away: the 20 streams fit on one replica and Serve
    removes the newer one, B. Its streams have a 1 s grace period, then move to A and go on from what their
    clients have. (A 4k context, so that A's requests outlast B's start, and B's outlast Serve's decision: with a
    5 s look-back window it and the grace period took 6 s on a host where 2000 tokens took about 16; the window is
    2 s here, and 1200 tokens keep that margin.)"""
    model_dir = build_tiny_model(tmp_path / "tiny-4k", context=4096)
    router = deploy_app(config(model_dir, max_num_seqs=24, context=4096, min_replicas=1, max_replicas=2,
                               downscale_delay_s=0, graceful_period_s=1))
    prompt, max_tokens = "w11 w12 w13 w14 w15", 1200

    async def scale_down_under_load() -> list[dict]:
        async with httpx.AsyncClient(base_url=ray_serve, timeout=300) as client:
            fillers = [asyncio.create_task(stream_text(client, "w3 w4", 4090)) for _ in range(24)]

            async def running(*inflight: int) -> bool:
                return [s["inflight"] for s in await router.replica_stats.remote()] == list(inflight)
            await until(lambda: running(24), "replica A running 24 requests", 60)
            streams = [asyncio.create_task(stream_text(client, prompt, max_tokens)) for _ in range(20)]
            await until(lambda: running(24, 20), "replica B running the 20 streams", 120)
            for filler in fillers:
                filler.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
            return await asyncio.gather(*streams)

    results = asyncio.run(scale_down_under_load())
    moved = httpx.get(f"{ray_serve}/metrics").text
    assert 'kvloom:requests_moved_total{how="continued",tenant="default"}' in moved, \
        "the streams ended before Serve removed their replica: nothing was tested"
    assert running_replicas() == 1
    uninterrupted = asyncio.run(alone(ray_serve, prompt, max_tokens))
    for result in results:
        assert result["status"] == 200 and result["done"] and not result["errors"], result
        assert result["text"] == uninterrupted["text"]

    def idle() -> bool:
        stats = router.replica_stats.remote().result()
        return len(stats) == 1 and stats[0]["kv_cache_usage"] == 0 and stats[0]["num_running"] == 0
    wait_until(idle, "the replica that stayed idle with every KV block free", 10)


def test_with_min_replicas_0_none_runs_while_idle_and_the_first_request_waits_for_one(
        ray_serve, deploy_app, tiny_model_dir):
    """The replica that starts says what its start was made of (`kvloom status` shows it)."""
    router = deploy_app(config(tiny_model_dir, max_num_seqs=4, min_replicas=0, max_replicas=1, downscale_delay_s=1,
                      graceful_period_s=1))
    assert running_replicas() == 0
    assert httpx.get(f"{ray_serve}/health").json() == {"status": "ok", "replicas": 0}
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{ray_serve}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    assert "kvloom:cold_start_seconds_count 1.0" in httpx.get(f"{ray_serve}/metrics").text
    [replica] = router.replica_stats.remote().result()
    assert list(replica["startup"]) == ["process start", "model files and tokenizer", "weights",
                                        "kernels and KV cache", "warm-up"]
    assert all(seconds > 0 for seconds in replica["startup"].values()), replica["startup"]
    wait_until(lambda: running_replicas() == 0, "the idle replica taken away", 60)
