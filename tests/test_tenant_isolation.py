"""Tenants share replicas, not data: a prompt's prefix-cache blocks are rooted in its tenant's namespace (and its
`cache_salt` within that), so another tenant's identical prompt hits nothing and holds blocks of its own, in one
engine, on a decode replica that received the KV, and on a replica continuing a cut stream."""

import itertools
import random

import pytest

from kvloom.engine.block_pool import prompt_block_hashes
from kvloom.engine.cache_namespace import chain_root, namespace_root
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.engine_replica import request_for
from kvloom.replicas.messages import SubmitRequest
from kvloom.router.tenants import Tenant, TenantConfig, TenantRegistry

BLOCK = 16
KV = 4 << 20  # bytes: room for a few 500-token prompts of the tiny model
GREEDY = SamplingParams(max_tokens=4, temperature=0)
ALICE, BOB = namespace_root("tenant:alice"), namespace_root("tenant:bob")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 512) for _ in range(500)]


@pytest.fixture
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=BLOCK, max_model_len=1024,
                     kv_cache_memory_bytes=KV)


ids = itertools.count()


def run(engine: LLMEngine, prompt: list[int], namespace: int | None) -> int:
    """The request's prefix-cache hit, in tokens, once it has run to its end."""
    request = engine.add_request(f"r{next(ids)}", prompt, GREEDY, cache_namespace=namespace)
    while engine.has_unfinished():
        engine.step()
    return request.num_cached_prompt_tokens


FULL_HIT = (500 - 1) // BLOCK * BLOCK  # every full block but the one holding the last token (computed for logits)


def test_the_same_prompt_from_two_tenants_shares_no_block_and_each_tenants_repeat_hits(engine, prompt):
    first = engine.add_request("alice-1", prompt, GREEDY, cache_namespace=ALICE)
    second = engine.add_request("bob-1", prompt, GREEDY, cache_namespace=BOB)
    engine.step()  # both admitted: their block tables now exist side by side
    assert first.block_ids and second.block_ids
    assert not set(first.block_ids) & set(second.block_ids)
    while engine.has_unfinished():
        engine.step()
    assert second.num_cached_prompt_tokens == 0
    assert not set(first.block_hashes) & set(second.block_hashes)
    assert run(engine, prompt, ALICE) == FULL_HIT
    assert run(engine, prompt, BOB) == FULL_HIT
    assert run(engine, prompt, None) == 0  # nor the open server's common namespace
    assert engine.stats().num_free_blocks == engine.num_blocks


def test_a_cache_salt_shares_only_within_its_tenant_and_salt(engine, prompt):
    salted = namespace_root("tenant:alice", "s1")
    assert run(engine, prompt, salted) == 0
    assert run(engine, prompt, namespace_root("tenant:alice", "s2")) == 0
    assert run(engine, prompt, namespace_root("tenant:bob", "s1")) == 0  # the same salt never escapes its tenant
    assert run(engine, prompt, ALICE) == 0  # nor is the tenant's unsalted cache the salted one
    assert run(engine, prompt, salted) == FULL_HIT


def test_the_routers_hashes_are_the_engines_for_every_namespace_and_adapter_root(engine, prompt):
    """Prefix affinity matches what a replica reports cached against the hashes the router computes."""
    assert run(engine, prompt, ALICE) == 0
    routed = prompt_block_hashes(prompt, BLOCK, chain_root(ALICE, None))
    assert set(routed[:FULL_HIT // BLOCK]) <= set(engine.kv.pool.cached)
    assert not set(prompt_block_hashes(prompt, BLOCK, chain_root(BOB, None))) & set(engine.kv.pool.cached)
    assert chain_root(ALICE, 5) not in (chain_root(BOB, 5), chain_root(ALICE, 6), chain_root(None, 5), ALICE)
    assert chain_root(None, None) is None and namespace_root(None) is None


def tenant(name: str, group: str | None = None) -> Tenant:
    return TenantRegistry([TenantConfig(name=name, api_keys=[f"sk-{name}"], prefix_cache_group=group)]).tenants[name]


def test_tenants_of_one_prefix_cache_group_share_a_namespace_and_no_one_else_does():
    assert tenant("a", "team").cache_namespace == tenant("b", "team").cache_namespace == "group:team"
    assert tenant("a").cache_namespace == "tenant:a" != tenant("b").cache_namespace
    assert tenant("team").cache_namespace != tenant("x", "team").cache_namespace  # a tenant's name is not a group
    assert TenantRegistry().anonymous.cache_namespace is None  # an open server: one tenant, as before


def message(request_id: str, prompt: list[int], namespace: int | None, max_tokens: int = 4) -> SubmitRequest:
    return SubmitRequest(request_id=request_id, prompt_token_ids=prompt, cache_namespace=namespace,
                         sampling=GREEDY.model_copy(update={"max_tokens": max_tokens}))


def finish(engine: LLMEngine) -> list[int]:
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    return done[0].outputs[0].token_ids


def test_a_decode_replica_and_a_replica_continuing_a_stream_keep_the_tenants_namespace(tiny_model_dir, prompt):
    """Both build the request from the router's message (replicas' `request_for`), which carries the namespace:
    the KV a decode engine received, and the prompt a successor recomputed, are found by their tenant only."""
    from kvloom.engine.kv_handoff import export_kv, import_kv

    def engine() -> LLMEngine:
        return LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=BLOCK, max_model_len=1024,
                     kv_cache_memory_bytes=KV)

    prefill, decode, successor = engine(), engine(), engine()
    request = request_for(prefill, message("alice-p", prompt, ALICE, max_tokens=1))
    request.park_kv = True
    prefill.add_prepared(request)
    first = finish(prefill)[0]
    _, payload = export_kv(prefill, "alice-p")
    assert import_kv(decode, request_for(decode, message("alice-d", prompt, ALICE)), first, payload)
    prefill.release_parked("alice-p")
    finish(decode)

    successor.add_continued(request_for(successor, message("alice-c", prompt, ALICE, max_tokens=8)), [first],
                            len(successor.tokenizer.decode([first])))
    finish(successor)
    for replica in (decode, successor):
        assert run(replica, prompt, BOB) == 0
        assert run(replica, prompt, ALICE) == FULL_HIT
    assert all(e.stats().num_free_blocks == e.num_blocks for e in (prefill, decode, successor))
