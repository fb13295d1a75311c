"""`kv_cache_dtype`: a float32 model with a float16 or bfloat16 KV cache.

The budget holds twice the tokens, the engine serves as usual and frees every block, and greedy
outputs stay close to the float32 cache's (rounding K/V may flip a near-tie, so most, not all,
tokens must agree).
"""

import random

import pytest

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

BUDGET = 64 << 20
GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(length)] for length in (4, 17, 40, 90, 150)]


@pytest.fixture(scope="module")
def float32_outputs(tiny_model_dir, prompts, drive):
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=BUDGET)
    return engine.num_blocks, [o.outputs[0].token_ids for o in drive(engine, prompts, GREEDY)]


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_narrow_cache_holds_twice_the_tokens_and_stays_close(tiny_model_dir, prompts, drive, float32_outputs,
                                                              kv_cache_dtype):
    full_blocks, want = float32_outputs
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=BUDGET,
                       kv_cache_dtype=kv_cache_dtype)
    assert engine.num_blocks == 2 * full_blocks
    assert str(engine.runner.kv_caches[0][0].dtype) == f"torch.{kv_cache_dtype}"
    got = [o.outputs[0].token_ids for o in drive(engine, prompts, GREEDY)]
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert agree >= 0.8 * sum(len(w) for w in want), (got, want)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
