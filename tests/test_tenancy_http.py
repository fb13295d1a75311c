"""Multi-tenancy over real HTTP on a local Ray cluster: keys, quotas, fair share, priority, usage.

One replica of the tiny random model (with a chat template) with max_num_seqs=2 and no router slack, so queues
form after two requests and the router's policy decides every order. Tests that need requests to be running wait
for their first tokens (an event), and make them long (EOS ignored) so they still run when the next one comes.
"""

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest

from kvloom.cluster.app import tenancy_user_config
from kvloom.cluster.config import ClusterConfig

pytestmark = pytest.mark.slow
PROMPT = "List three facts about the moon:"
TENANTS = [
    {"name": "alice", "api_keys": ["sk-alice"]},
    {"name": "bob", "api_keys": ["sk-bob"]},
    {"name": "carol", "api_keys": ["sk-carol"]},
    {"name": "dave", "api_keys": ["sk-dave"], "weight": 2},
    {"name": "metered", "api_keys": ["sk-metered"], "quotas": {"requests_per_minute": 3}},
    {"name": "tokens", "api_keys": ["sk-tokens"], "quotas": {"tokens_per_minute": 60}},
    {"name": "solo", "api_keys": ["sk-solo"], "quotas": {"max_concurrent_requests": 1}},
    {"name": "impatient", "api_keys": ["sk-impatient"], "quotas": {"max_queue_wait_s": 0.5}},
    {"name": "vip", "api_keys": ["sk-vip"], "best_priority": -10},
    {"name": "batch", "api_keys": ["sk-batch"], "priority": 5},
    {"name": "team-a", "api_keys": ["sk-team-a"], "prefix_cache_group": "team"},
    {"name": "team-b", "api_keys": ["sk-team-b"], "prefix_cache_group": "team"},
]
LONG = 900  # tokens: streams that outlast what a test does meanwhile on any host; it cancels them after
# (their clients walk away), so a slow host does not decode them to the end
CONFIG = {
    "served_model_name": "tiny",
    "engine": {"dtype": "float32", "kv_cache_memory_bytes": 16 << 20, "max_model_len": 1024, "max_num_seqs": 2},
    "num_replicas": 1,
    "router": {"replica_slack": 0, "policy": "priority+fair", "priority_aging_s": None,
               "metrics_require_admin": True},
    "tenants": TENANTS,
    "admin_keys": ["sk-admin"],
}


@dataclass
class Result:
    status: int
    body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    ttft: float | None = None
    e2e: float = 0.0
    finished_at: float = 0.0
    usage: dict | None = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, build_tiny_model):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-chat"), chat=True)


def config(model_dir, tenants=TENANTS) -> ClusterConfig:
    return ClusterConfig.model_validate({**CONFIG, "engine": {**CONFIG["engine"], "model": str(model_dir)},
                                         "tenants": tenants})


@pytest.fixture(scope="module")
def server(ray_serve, deploy_app, model_dir):
    router = deploy_app(config(model_dir))
    return ray_serve, router


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def stream(base: str, key: str, max_tokens: int = 8, path: str = "/v1/completions",
                 started: asyncio.Event | None = None, **extra) -> Result:
    """A streamed request with usage; records time to first token and completion time, and sets `started` at
    its first token."""
    body = {"model": "tiny", "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "ignore_eos": True, **extra}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{base}{path}", json=body, headers=auth(key)) as response:
            if response.status_code != 200:
                await response.aread()
                return Result(response.status_code, response.json(), dict(response.headers))
            result = Result(200)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if result.ttft is None:
                    result.ttft = time.monotonic() - start
                    if started is not None:
                        started.set()
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                result.usage = chunk.get("usage") or result.usage
    result.finished_at = time.monotonic()
    result.e2e = result.finished_at - start
    return result


def streams(base: str, key: str, count: int, max_tokens: int = LONG, **extra) -> tuple[list, list[asyncio.Event]]:
    """`count` streamed requests started at once: their tasks, and the events set at their first tokens."""
    events = [asyncio.Event() for _ in range(count)]
    return [asyncio.create_task(stream(base, key, max_tokens, started=e, **extra))
            for e in events], events


async def walk_away(tasks: list[asyncio.Task]) -> None:
    """The clients of these streams close their connections."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def first_tokens(events: list[asyncio.Event], count: int, timeout_s: float = 60) -> None:
    """Until `count` of the streams have their first token (the rest: queued behind them)."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        async with asyncio.timeout(timeout_s):
            while sum(e.is_set() for e in events) < count:
                await asyncio.wait([w for w in waits if not w.done()], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def complete(base: str, key: str | None, max_tokens: int = 4, **extra) -> Result:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(f"{base}/v1/completions", json=body, headers=auth(key))
    data = response.json()
    return Result(response.status_code, data, dict(response.headers), e2e=time.monotonic() - start,
                  finished_at=time.monotonic(), usage=data.get("usage"))


def usage(base: str) -> dict[str, dict]:
    response = httpx.get(f"{base}/v1/usage", headers=auth("sk-admin"), timeout=30)
    assert response.status_code == 200, response.text
    return {entry["tenant"]: entry for entry in response.json()["data"]}


async def preemptions(router) -> int:
    return sum(r["num_preemptions"] for r in await router.replica_stats.remote())


async def test_keys_map_to_tenants(server):
    base, _ = server
    before = usage(base)["alice"]["requests"]
    assert (await complete(base, "sk-alice")).status == 200
    assert usage(base)["alice"]["requests"] == before + 1


@pytest.mark.parametrize("key", [None, "sk-wrong", "sk-admin"])
async def test_missing_or_bad_key_is_401(server, key):
    base, _ = server
    result = await complete(base, key)
    assert result.status == 401 and result.body["error"]["type"] == "authentication_error"
    assert result.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/models", headers=auth(key), timeout=30).status_code == 401


def test_usage_shows_a_tenant_only_itself_and_an_admin_everyone(server):
    base, _ = server
    for key in (None, "sk-wrong"):
        assert httpx.get(f"{base}/v1/usage", headers=auth(key), timeout=30).status_code == 401
    own = httpx.get(f"{base}/v1/usage", headers=auth("sk-alice"), timeout=30).json()["data"]
    assert [entry["tenant"] for entry in own] == ["alice"]
    assert {"alice", "bob", "team-a"} <= set(usage(base))


async def cached_tokens(base: str, key: str, prompt: list[int], **extra) -> int:
    result = await complete(base, key, max_tokens=1, prompt=prompt, **extra)
    assert result.status == 200, result.body
    return result.usage["prompt_tokens_details"]["cached_tokens"]


async def test_another_tenants_identical_prompt_hits_nothing_and_a_group_shares(server):
    """A 500-token prompt: the tenant's own repeat is a full hit; another tenant's is cold; tenants of one
    prefix_cache_group share; a cache_salt hits only with the same salt and tenant."""
    base, _ = server
    prompt = [3 + (i * 7919) % 509 for i in range(500)]
    full = (500 - 1) // 16 * 16
    assert await cached_tokens(base, "sk-alice", prompt) == 0
    assert await cached_tokens(base, "sk-alice", prompt) == full
    assert await cached_tokens(base, "sk-bob", prompt) == 0
    assert await cached_tokens(base, "sk-team-a", prompt) == 0
    assert await cached_tokens(base, "sk-team-b", prompt) == full  # one group: shared
    assert await cached_tokens(base, "sk-alice", prompt, cache_salt="s1") == 0
    assert await cached_tokens(base, "sk-bob", prompt, cache_salt="s1") == 0
    assert await cached_tokens(base, "sk-alice", prompt, cache_salt="s1") == full


async def test_requests_per_minute_429_on_the_fourth_request_with_retry_after(server):
    base, _ = server
    results = [await complete(base, "sk-metered", max_tokens=1) for _ in range(4)]
    assert [r.status for r in results] == [200, 200, 200, 429]
    error = results[3].body["error"]
    assert error["code"] == "requests_per_minute" and error["type"] == "rate_limit_error"
    assert 1 <= int(results[3].headers["retry-after"]) <= 20
    assert usage(base)["metered"]["rejected"] == {"requests_per_minute": 1}


async def test_tokens_per_minute_debt_lets_the_request_finish_and_delays_the_next(server):
    base, _ = server
    first = await complete(base, "sk-tokens", max_tokens=100, ignore_eos=True)  # budget 60: runs into debt
    assert first.status == 200 and first.usage["completion_tokens"] == 100
    second = await complete(base, "sk-tokens", max_tokens=1)
    assert second.status == 429 and second.body["error"]["code"] == "tokens_per_minute"
    assert int(second.headers["retry-after"]) >= 5  # the debt (~50 tokens at 1 token/s) must be repaid first


async def test_max_concurrent_requests(server):
    base, _ = server
    (running,), started = streams(base, "sk-solo", 1, max_tokens=300)  # decoded to its end: the slot frees
    await first_tokens(started, 1)
    refused = await complete(base, "sk-solo")
    assert refused.status == 429 and refused.body["error"]["code"] == "max_concurrent_requests"
    assert "retry-after" in refused.headers
    assert (await running).status == 200
    assert (await complete(base, "sk-solo")).status == 200
    assert (await complete(base, "sk-solo", n=3)).status == 200  # a prompt's choices ride on one admission


async def test_queue_wait_over_the_tenant_limit_is_503(server):
    base, _ = server
    # two tenants share the two slots: a third is below a whole slot's share, so it cannot preempt; both slots
    # stay taken past its 0.5 s wait
    alice, alice_started = streams(base, "sk-alice", 2)
    bob, bob_started = streams(base, "sk-bob", 2)
    busy = alice + bob
    await first_tokens(alice_started + bob_started, 2)
    result = await complete(base, "sk-impatient")
    assert not any(task.done() for task in busy), "a slot freed during the wait: nothing was tested"
    assert result.status == 503 and result.body["error"]["code"] == "max_queue_wait_s"
    assert "retry-after" in result.headers
    await walk_away(busy)


async def test_a_flood_does_not_push_another_tenant_over_its_latency_goal(server):
    """bob alone, then bob while alice floods: bob's goal is to wait no longer than one request."""
    base, _ = server
    length = 100  # tokens, each request: long enough for a queue to form behind the two running ones
    alone = await stream(base, "sk-bob", max_tokens=length)
    flood, started = streams(base, "sk-alice", 10, max_tokens=length)
    await first_tokens(started, 2)  # the flood is in: two running, the rest queued
    sent = time.monotonic()
    bob = await stream(base, "sk-bob", max_tokens=length)
    alice = await asyncio.gather(*flood)
    assert all(r.status == 200 for r in alice) and bob.status == 200
    ahead = [r for r in alice if r.finished_at > sent]  # still running or queued when bob came
    assert len(ahead) >= 6, len(ahead)  # a fast engine may have finished a few: the rest is the test
    overtook = sum(r.finished_at < bob.finished_at for r in ahead)
    assert overtook <= 3, overtook  # the two running and at most one beside bob; FCFS: every one of them
    assert bob.ttft <= 2.0 * alone.e2e + 1.0, (bob.ttft, alone.e2e)


async def test_high_priority_overtakes_the_queue_and_preempts_in_the_engine(server):
    base, router = server
    preempted_before = await preemptions(router)
    low, started = streams(base, "sk-batch", 5)
    await first_tokens(started, 2)  # the engine runs two, three wait in the router
    urgent = await stream(base, "sk-vip", max_tokens=8, priority=-5)
    assert urgent.status == 200
    assert not any(task.done() for task in low)  # it finished ahead of every low one, even the running ones
    await walk_away(low)
    deadline = time.monotonic() + 5
    while await preemptions(router) == preempted_before:  # stats reach the router every 0.5 s
        assert time.monotonic() < deadline, "the engine never preempted"
        await asyncio.sleep(0.2)
    forbidden = await complete(base, "sk-vip", priority=-20)
    assert forbidden.status == 403 and forbidden.body["error"]["param"] == "priority"


async def test_usage_equals_the_sum_of_usage_returned_to_clients(server):
    base, _ = server
    before = usage(base)
    calls = [complete(base, "sk-carol", max_tokens=5), complete(base, "sk-dave", max_tokens=7),
             stream(base, "sk-carol", max_tokens=6), stream(base, "sk-dave", max_tokens=3),
             stream(base, "sk-carol", max_tokens=9, path="/v1/chat/completions"),
             complete(base, "sk-dave", max_tokens=4, stop=["\n"]),
             complete(base, "sk-carol", max_tokens=3, n=3), complete(base, "sk-dave", max_tokens=2)]
    results = await asyncio.gather(*calls)
    after = usage(base)
    assert httpx.get(f"{base}/metrics", timeout=30).status_code == 401  # its labels name tenants
    assert httpx.get(f"{base}/metrics", headers=auth("sk-alice"), timeout=30).status_code == 401
    metrics = httpx.get(f"{base}/metrics", headers=auth("sk-admin"), timeout=30).text
    for tenant, key_results in (("carol", results[0::2]), ("dave", results[1::2])):
        returned = {k: sum(r.usage[k] for r in key_results) for k in ("prompt_tokens", "completion_tokens")}
        got = {k: after[tenant][k] - before[tenant][k] for k in returned}
        assert got == returned
        assert after[tenant]["requests"] - before[tenant]["requests"] == 4  # a prompt's n choices: one request
        generated = (f'kvloom:generation_tokens_total{{lora="",tenant="{tenant}"}} '
                     f'{float(after[tenant]["completion_tokens"])}')
        assert generated in metrics


async def test_reload_adds_keys_and_keeps_usage(server, model_dir):
    base, router = server
    before = usage(base)
    new = config(model_dir, TENANTS + [{"name": "erin", "api_keys": ["sk-erin"]}])
    try:
        await router.reconfigure.remote(tenancy_user_config(new))
        assert (await complete(base, "sk-erin")).status == 200
        after = usage(base)
        assert after["alice"] == before["alice"] and after["erin"]["requests"] == 1
    finally:
        await router.reconfigure.remote(tenancy_user_config(config(model_dir)))
    assert (await complete(base, "sk-erin")).status == 401
