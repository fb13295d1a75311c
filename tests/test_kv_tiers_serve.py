"""KV tiers across the replicas of a node (issue 71): a tier remembers the blocks it wrote, read or found, which its
replica reports to the router; and over real HTTP (a local Ray cluster, two replicas of the tiny random model sharing
one host tier), a prefix one replica computed is a tier hit for the other, with the same output, while tenants' and
adapters' identical prompts never get each other's blocks. Routing on tiers itself: tests/test_router_units.py."""

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvloom.benchmarks.random_weights import write_random_adapter
from kvloom.cluster.config import ClusterConfig
from kvloom.engine.block_pool import prompt_block_hashes
from kvloom.engine.cache_namespace import chain_root, namespace_root
from kvloom.engine.kv_tiers.block_store import SUFFIX, BlockStore, file_bytes
from kvloom.engine.llm import LLM
from kvloom.engine.lora.identity import cache_root_of
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

BLOCK = 16
MAX_TOKENS = 8
POOL = 1 << 24  # KV bytes of the offline reference (the default 2 GiB costs an engine 1-7 s to fault in here)
BUSY_TOKENS = 900  # a stream that outlasts what the test does meanwhile; cancelled after
TENANTS = [{"name": "alice", "api_keys": ["sk-alice"]}, {"name": "bob", "api_keys": ["sk-bob"]}]
ALICE, BOB = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}


def test_a_tier_remembers_the_blocks_it_wrote_read_or_found_and_forgets_those_it_lost(tmp_path):
    tokens, payload, identity = tuple(range(BLOCK)), memoryview(bytes(256)), bytes(16)
    writer = BlockStore(tmp_path / "host", 1 << 20, identity)
    reader = BlockStore(tmp_path / "host", 1 << 20, identity)  # another replica of the node
    writer.put(1, tokens, payload)
    writer.put(2, tokens, payload)
    assert writer.seen.latest(10) == [1, 2] and reader.seen.latest(10) == []
    assert reader.contains(2) and not reader.contains(3)
    out = memoryview(bytearray(file_bytes(len(tokens), len(payload))))
    assert reader.read_into(1, tokens, out)
    assert reader.seen.latest(10) == [2, 1] and reader.seen.latest(1) == [1]  # the most recent last
    writer.file(2).write_bytes(b"torn")
    assert not reader.read_into(2, tokens, out)
    assert reader.seen.latest(10) == [1]

    disk = BlockStore(tmp_path / "disk", 1 << 20, identity)
    host = BlockStore(tmp_path / "small-host", file_bytes(len(tokens), len(payload)), identity, below=disk)
    host.put(1, tokens, payload)
    host.put(2, tokens, payload)  # past the budget: block 1 spills to disk
    assert host.seen.latest(10) == [2] and disk.seen.latest(10) == [1]


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def reachable(prompt: list[int]) -> int:
    """The full blocks a repeat of `prompt` can reuse: all but the one holding its last token (computed for its
    logits)."""
    return (len(prompt) - 1) // BLOCK


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> str:
    config = ModelConfig.from_dir(tiny_model_dir)
    return str(write_random_adapter(tmp_path_factory.mktemp("tier-adapter") / "qv", config, 4, targets=("q_proj", "v_proj")))


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapter) -> Callable[[list[int], str | None], str]:
    """A prompt's greedy text under the base model or the adapter, from the offline engine."""
    llm = LLM(str(tiny_model_dir), dtype="float32", lora={"adapters": {"qv": adapter}}, kv_cache_memory_bytes=POOL)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return lambda prompt, lora: llm.generate(prompt, greedy, lora=lora)[0].outputs[0].text


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory) -> Path:
    """The node's host tier (a folder per model identity inside)."""
    return tmp_path_factory.mktemp("host-tier")


@pytest.fixture(scope="module")
def server(ray_serve, deploy_app, tiny_model_dir, adapter, tier_dir):
    config = ClusterConfig.model_validate({
        "served_model_name": "tiny", "num_replicas": 2, "tenants": TENANTS,
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "kv_cache_memory_bytes": 8 << 20,
                   "max_model_len": 1024, "max_num_seqs": 4,
                   "kv_tiers": {"host_bytes": 64 << 20, "host_path": str(tier_dir)}},
        "lora": {"adapters": {"qv": adapter}, "max_lora_rank": 8},
        "router": {"imbalance_threshold": 0},  # a replica running one request more than another is too busy
        "resources": {"num_cpus": 1, "torch_threads": 1},
    })
    return ray_serve, deploy_app(config)


def body(prompt: list[int], model: str = "tiny", max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def completion(response: httpx.Response) -> tuple[str, int]:
    """The text and the prompt tokens the replica found cached (in its pool or a tier)."""
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def post(base: str, key: dict, prompt: list[int], model: str = "tiny") -> tuple[str, int]:
    return completion(httpx.post(f"{base}/v1/completions", headers=key, json=body(prompt, model), timeout=60))


def settled(router, check: Callable[[dict[str, dict]], bool], within_s: float = 30.0) -> dict[str, dict]:
    """Each replica's stats by id, as the router has them, once `check` holds for them (replicas report every half
    second)."""
    deadline = time.monotonic() + within_s
    while not check(stats := {s["replica_id"]: s for s in router.replica_stats.remote().result()}):
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def host_tier(stats: dict) -> dict:
    return stats["kv_tiers"]["host"]


def tier_holds(tier_dir: Path, hashes: list[int], within_s: float = 30.0) -> bool:
    """Whether the host tier has a file for each of these blocks within `within_s` (written through off the step)."""
    names = [f"{block_hash:032x}{SUFFIX}" for block_hash in hashes]
    deadline = time.monotonic() + within_s
    while not all(any((folder / name).exists() for folder in tier_dir.iterdir()) for name in names):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def while_busy(base: str, busy_prompt: list[int], prompt: list[int]) -> tuple[str, int]:
    """`prompt`'s completion, sent while a stream of `busy_prompt` runs (from its first token on)."""
    async with httpx.AsyncClient(base_url=base, headers=ALICE, timeout=60) as client:
        started = asyncio.Event()

        async def busy() -> None:
            async with client.stream("POST", "/v1/completions",
                                     json=body(busy_prompt, max_tokens=BUSY_TOKENS, stream=True)) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        started.set()

        stream = asyncio.create_task(busy())
        try:
            await asyncio.wait_for(started.wait(), 60)
            return completion(await client.post("/v1/completions", json=body(prompt)))
        finally:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)


def metric(base: str, name: str, replica: str) -> float:
    line = f'{name}{{replica="{replica}",tier="host"}} '
    found = [row for row in httpx.get(f"{base}/metrics").text.splitlines() if row.startswith(line)]
    assert found, f"no {line} in /metrics"
    return float(found[0].removeprefix(line))


def test_a_prefix_one_replica_computed_is_a_tier_hit_for_the_other_with_the_same_output(server, expected):
    base, router = server
    prompt = random_prompt(400, seed=1)
    blocks, reused = len(prompt) // BLOCK, reachable(prompt)
    text, cached = post(base, ALICE, prompt)
    assert text == expected(prompt, None) and cached == 0
    stats = settled(router, lambda s: any(host_tier(r)["blocks_written"] >= blocks and r["tier_prefix_hashes"] >= blocks
                                          for r in s.values()))  # written through, and reported
    holder = next(r for r, s in stats.items() if host_tier(s)["blocks_written"] >= blocks)
    other = next(r for r in stats if r != holder)
    before, hits_metric = stats[other], metric(base, "kvloom:kv_tier_hits_total", other)

    # the holder's pool draws the stream there; then the holder is too busy, and the prompt goes to the other
    again, cached = asyncio.run(while_busy(base, prompt[:2 * BLOCK] + random_prompt(8, seed=2), prompt))
    assert again == text and cached == reused * BLOCK

    after = settled(router, lambda s: host_tier(s[other])["hits"] >= host_tier(before)["hits"] + reused)[other]
    assert host_tier(after)["hits"] - host_tier(before)["hits"] == reused  # the engine's counters, as reported
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == reused * BLOCK
    assert after["tier_prefix_hashes"] >= reused  # it reports them as its node's tier's now
    assert metric(base, "kvloom:kv_tier_hits_total", other) - hits_metric == reused


def test_tenants_and_adapters_never_get_each_others_blocks_from_the_tier(server, expected, adapter, tier_dir):
    """Alice's base-model blocks are in the node's tier; Bob's identical prompt, and Alice's under an adapter, hit
    nothing (pool or tier) and write blocks of their own; Alice's own repeat hits."""
    base, router = server
    prompt = random_prompt(300, seed=3)
    alice = namespace_root("tenant:alice")
    roots = {"alice": chain_root(alice, None), "bob": chain_root(namespace_root("tenant:bob"), None),
             "alice under qv": chain_root(alice, cache_root_of("qv", adapter))}

    def totals(stats: dict[str, dict]) -> tuple[int, int, int]:
        """Prompt tokens looked up, found cached, and blocks found in the tier, over both replicas."""
        return tuple(sum(f(s) for s in stats.values()) for f in (
            lambda s: s["prefix_cache_queries"], lambda s: s["prefix_cache_hits"], lambda s: host_tier(s)["hits"]))

    since = time.time()  # reports from then on show the last test's stream gone, and count all it did
    looked_up, cached_hits, tier_hits = totals(settled(router, lambda s: all(
        r["time"] > since and r["num_running"] == r["num_waiting"] == 0 for r in s.values())))
    for key, model, lora, root in ((ALICE, "tiny", None, "alice"), (BOB, "tiny", None, "bob"),
                                   (ALICE, "qv", "qv", "alice under qv")):
        assert post(base, key, prompt, model) == (expected(prompt, lora), 0)
        looked_up += len(prompt)
        stats = settled(router, lambda s: totals(s)[0] >= looked_up)
        assert totals(stats) == (looked_up, cached_hits, tier_hits), root  # no hit anywhere, tier included
        own = prompt_block_hashes(prompt, BLOCK, roots[root])[:len(prompt) // BLOCK]
        assert tier_holds(tier_dir, own), root  # written through: blocks of its own, under hashes of its own

    text, cached = post(base, ALICE, prompt)  # her own blocks, from wherever it runs
    assert text == expected(prompt, None) and cached == reachable(prompt) * BLOCK
