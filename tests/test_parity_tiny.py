"""The engine produces exactly the tokens transformers `generate` does, on a tiny random GQA Llama.

Every scheduling path (one batch, chunked prefill, preemption, prefix hits, late arrivals) must
leave the math untouched.
"""

import random

import pytest
import torch

from kvloom.engine.model.decoder import FusedDecoder
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
POOL = 1 << 24  # KV bytes: room for these prompts (zeroing the default 2 GiB costs every engine ~0.2 s)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # a "system prompt" spanning blocks
    out = []
    for i, length in enumerate([3, 5, 9, 16, 17, 31, 33, 64, 90, 150, 200, 260]):
        body = [rng.randrange(3, 512) for _ in range(length)]
        out.append(shared + body if i % 2 else body)
    return out


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts, greedy_reference):
    return greedy_reference(tiny_model_dir, prompts, MAX_NEW)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("model_impl", ["kvloom", "transformers"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_one_concurrent_batch_matches_generate(tiny_model_dir, prompts, expected, drive, backend, model_impl):
    """Both forwards: kvloom's fused decoder and the stock model with paged attention plugged in."""
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       attention_backend=backend, model_impl=model_impl)
    assert isinstance(engine.decoder, FusedDecoder) == (model_impl == "kvloom")
    assert tokens(drive(engine, prompts, GREEDY)) == expected


def test_chunked_prefill_matches_generate(tiny_model_dir, prompts, expected, drive):
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       max_num_batched_tokens=32, max_num_seqs=16)
    assert tokens(drive(engine, prompts, GREEDY)) == expected


def test_preemption_by_recompute_matches_generate(tiny_model_dir, prompts, expected, drive):
    # 16 blocks of 16 tokens: room for one max-length request, far less than the batch needs
    engine = LLMEngine(dtype="float32",
        model=str(tiny_model_dir), block_size=16, max_model_len=256,
        kv_cache_memory_bytes=16 * 16 * engine_kv_bytes_per_token(tiny_model_dir),
    )
    short = [p for p in prompts if len(p) + MAX_NEW <= 256]
    want = [e for p, e in zip(prompts, expected) if len(p) + MAX_NEW <= 256]
    assert tokens(drive(engine, short, GREEDY)) == want
    assert engine.stats().num_preemptions > 0


def test_prefix_cache_hits_match_generate(tiny_model_dir, prompts, expected, drive):
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    late = {0: [1], 3: [i for i in range(len(prompts)) if i != 1]}
    assert tokens(drive(engine, prompts, GREEDY, late)) == expected
    assert engine.stats().prefix_cache_hits > 0


def test_choices_forking_a_siblings_prompt_match_generate(tiny_model_dir, prompts, expected):
    """n > 1: choice 1 arrives once choice 0 has its first token (as the router sends them) and forks its
    prompt's KV (full blocks shared, a partial last block copied): it computes only the prompt's last token."""
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"first{i}", prompt, GREEDY)
    finished = {}
    while not all(engine.requests[f"first{i}"].output_token_ids for i in range(len(prompts))):
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    for i, prompt in enumerate(prompts):
        second = engine.make_request(f"second{i}", prompt, GREEDY)
        second.fork_of = f"first{i}"
        engine.add_prepared(second)
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    for name in ("first", "second"):
        assert [finished[f"{name}{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert [finished[f"second{i}"].num_cached_tokens for i in range(len(prompts))] == [len(p) - 1 for p in prompts]
    assert engine.kv.pool.num_used == 0


def test_requests_added_mid_decode_match_generate(tiny_model_dir, prompts, expected, drive):
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=8, kv_cache_memory_bytes=POOL)
    half = len(prompts) // 2
    arrivals = {0: list(range(half)), 5: list(range(half, len(prompts) - 2)), 11: [len(prompts) - 2, len(prompts) - 1]}
    assert tokens(drive(engine, prompts, GREEDY, arrivals)) == expected


def engine_kv_bytes_per_token(model_dir) -> int:
    return ModelConfig.from_dir(model_dir).kv_bytes_per_token(torch.float32)
