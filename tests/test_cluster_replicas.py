"""Several replicas behind the router: spreading load, rescaling by config, and a bounded load test.
Real Ray, real HTTP on loopback, the tiny random model (what is tested is the cluster, not the model's text).
Killed replicas and their streams: test_chaos.py."""

import asyncio
import time

import httpx
import pytest
from pydantic import ValidationError
from ray import serve

from kvloom.cluster.cli import DEFAULT_CONFIG
from kvloom.cluster.config import load_cluster_config
from kvloom.engine.cpu_threads import share_of_node, usable_cpus
from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.messages import ActorName, Chunk, Continuation, StepChunks, SubmitReply, SubmitRequest

pytestmark = pytest.mark.slow

YAML = """
name: kvloom
served_model_name: tiny
engine:
  model: {model}
  dtype: float32  # greedy output is the same whichever replica computes it
  kv_cache_memory_bytes: 16777216
  max_model_len: 1024
  max_num_seqs: 8
num_replicas: {replicas}
resources:
  num_cpus: 1
  torch_threads: 1
"""


def write_config(tmp_path, model_dir, replicas: int):
    path = tmp_path / f"cluster-{replicas}.yaml"
    path.write_text(YAML.format(model=model_dir, replicas=replicas))
    return load_cluster_config(path)


@pytest.fixture(scope="module")
def two_replicas(ray_serve, deploy_app, tmp_path_factory, tiny_model_dir):
    router = deploy_app(write_config(tmp_path_factory.mktemp("cfg"), tiny_model_dir, 2))
    return ray_serve, router


async def complete(client: httpx.AsyncClient, prompt: str, max_tokens: int = 12, stream: bool = False) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        return {"status": response.status_code, "body": response.json()}
    events = []
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return {"status": response.status_code, "events": events}


def running_replicas() -> int:
    return serve.status().applications["kvloom"].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def test_concurrent_requests_use_both_replicas(two_replicas):
    base, router = two_replicas

    async def burst():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            return await asyncio.gather(*(complete(client, f"Story number {i} begins with a") for i in range(12)))

    results = asyncio.run(burst())
    assert all(r["status"] == 200 for r in results)
    served = {s["replica_id"]: s["dispatched"] for s in router.replica_stats.remote().result()}
    assert len(served) == 2 and all(count > 0 for count in served.values()), served


def test_a_channel_whose_router_is_gone_ends_within_seconds(two_replicas):
    """A router killed while its channel idles never reads it again, and Ray does not end the call: the replica
    checks the channel's reader every second and ends it (an open one held the replica's stop for Serve's whole
    graceful period, and ran its requests for nobody)."""
    _, router = two_replicas
    target = router.replica_stats.remote().result()[0]["replica_id"]
    replicas = serve.get_deployment_handle("EngineReplica", "kvloom")
    gone = ActorName("SERVE_REPLICA::kvloom#Router#gone", "serve")

    async def read_to_the_end() -> list[StepChunks]:
        stream = replicas.options(stream=True).outputs.remote("orphan", target_replica=target, caller=gone)
        return [step async for step in stream]

    steps = asyncio.run(asyncio.wait_for(read_to_the_end(), 30))
    assert [(step.replica, step.chunks) for step in steps] == [(target, [])]  # its first item, then the end


def test_a_replica_sends_its_channel_a_step_of_every_request_per_message(two_replicas):
    """The router's requests come back over one stream per replica, not one per request (see router/channels); the
    typed messages (replicas/messages.py) cross Ray both ways as themselves."""
    _, router = two_replicas
    target = router.replica_stats.remote().result()[0]["replica_id"]
    replicas = serve.get_deployment_handle("EngineReplica", "kvloom")
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    async def run():
        stream = replicas.options(stream=True).outputs.remote("spec-channel", target_replica=target)
        hello = await stream.__anext__()
        ids = [f"channel-{i}" for i in range(4)]
        replies = await asyncio.gather(*(replicas.submit.remote(
            SubmitRequest(request_id=rid, prompt_token_ids=[1, 2, 3, 4 + i], sampling=sampling), "spec-channel",
            target_replica=target) for i, rid in enumerate(ids)))
        tokens, messages = {rid: [] for rid in ids}, 0
        async for step in stream:
            messages += 1
            assert isinstance(step, StepChunks) and all(isinstance(c, Chunk) and c.error is None for c in step.chunks)
            for chunk in step.chunks:
                tokens[chunk.request_id] += chunk.token_ids
            if all(len(t) == 16 for t in tokens.values()):
                stream.cancel()
                return hello, replies, tokens, messages

    hello, replies, tokens, messages = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert hello == StepChunks(target) and replies == [SubmitReply(target)] * 4
    assert messages < sum(len(t) for t in tokens.values()) / 2


@pytest.mark.parametrize("message, field", [
    ({"request_id": "old", "prompt_token_ids": [1, 2], "sampling": {}, "priority": 3}, "priority"),  # the old name
    ({"request_id": "hot", "prompt_token_ids": [1, 2], "sampling": {"temperature": -1}}, "sampling"),
    ({"request_id": "", "prompt_token_ids": [1, 2], "sampling": {}}, "request_id"),
    ({"request_id": "empty", "prompt_token_ids": [], "sampling": {}}, "prompt"),  # the engine's check, its name
    ({"request_id": "long", "prompt_token_ids": [1, 2], "sampling": {"max_tokens": 10**6}}, "max_tokens"),
])
def test_a_message_with_a_bad_field_is_refused_at_the_replica_naming_the_field(two_replicas, message, field):
    _, router = two_replicas
    target = router.replica_stats.remote().result()[0]["replica_id"]
    replicas = serve.get_deployment_handle("EngineReplica", "kvloom")
    reply = replicas.submit.remote(message, "bad-field-channel", target_replica=target).result()
    assert reply.replica == target and reply.error is not None and reply.error.param == field, reply


def test_a_submit_request_checks_its_fields_where_it_is_built():
    with pytest.raises(ValidationError, match="request_id"):
        SubmitRequest(request_id="", prompt_token_ids=[1], sampling=SamplingParams())
    with pytest.raises(ValidationError, match="engine_priorty"):
        SubmitRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(), engine_priorty=1)
    with pytest.raises(ValidationError, match="output_token_ids"):
        Continuation(output_token_ids=[], emitted_chars=0)


def test_bounded_load_200_requests_32_concurrent(two_replicas):
    base, _ = two_replicas

    async def load():
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            async def one(i):
                async with limit:
                    return await complete(client, f"Item {i}: a short note about", 16, stream=i % 3 == 0)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=540)
            return results, time.monotonic() - start

    results, elapsed = asyncio.run(load())
    ok = [r for r in results if r["status"] == 200 and r.get("events", ["[DONE]"])[-1] == "[DONE]"]
    assert len(ok) == 200
    tokens = sum(r["body"]["usage"]["completion_tokens"] for r in results if "body" in r)
    print(f"\nload test: 200 requests in {elapsed:.1f} s = {200 / elapsed:.2f} req/s; "
          f"non-streamed completion tokens {tokens}")


def test_rescale_by_editing_num_replicas(two_replicas, deploy_app, tmp_path, tiny_model_dir):
    router = deploy_app(write_config(tmp_path, tiny_model_dir, 1))
    deadline = time.monotonic() + 60
    while len(router.replica_stats.remote().result()) != 1 or running_replicas() != 1:
        assert time.monotonic() < deadline, "did not scale down"
        time.sleep(0.5)


def test_the_shipped_default_gives_a_lone_replica_every_cpu_and_splits_them_between_two(ray_serve, deploy_app,
                                                                                         tiny_model_dir):
    """configs/local-cpu.yaml as shipped (the tiny model and a smaller KV budget aside): its one replica runs on all
    the CPUs its process may use, and two replicas on the node get half each; each says so in its stats."""
    shipped = load_cluster_config(DEFAULT_CONFIG)
    assert shipped.resources.torch_threads is None
    engine = shipped.engine.model_copy(update={"model": str(tiny_model_dir), "kv_cache_memory_bytes": 16 << 20,
                                               "max_model_len": 1024})
    lone = shipped.model_copy(update={"engine": engine})
    for config, threads in ((lone, usable_cpus()), (lone.model_copy(update={"num_replicas": 2}),
                                                    share_of_node(usable_cpus(), 2))):
        router = deploy_app(config)
        deadline = time.monotonic() + 60
        while [s["torch_threads"] for s in router.replica_stats.remote().result()] != [threads] * config.num_replicas:
            assert time.monotonic() < deadline, router.replica_stats.remote().result()
            time.sleep(0.5)
