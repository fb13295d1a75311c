"""Acceptance: on the real SmolLM2-135M, greedy float32 outputs equal transformers `generate` token for token.

16 varied prompts (chat-templated and raw, 5 to ~600 tokens, 32 new tokens) run as one concurrent batch on all
30 layers. The same prompts run again under chunked prefill, preemption, prefix-cache hits and late arrivals on
SmolLM2 cut to four layers (tests/conftest.py), against transformers on that same cut: the same tokenizer, KV
shapes and kernels, its greedy picks as close to ties as the full model's (smallest top-two logit gap 0.005
against 0.0006 on these prompts), at a seventh of the compute. bfloat16 (dtype `auto` on CPUs with bfloat16
units) is held to the full model's float32 outputs' first tokens.
"""

import pytest
import torch

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # setup runs transformers 16x32 steps
MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
KV = 1 << 28  # 5,800 float32 tokens: the 16 prompts and outputs take 2,300; the 2 GiB default takes seconds to start

@pytest.fixture(scope="module")
def expected(smollm2_dir, smollm2_prompts, greedy_reference):
    return greedy_reference(smollm2_dir, smollm2_prompts, MAX_NEW, batch=8)


@pytest.fixture(scope="module")
def cut(smollm2_4_layers_dir, smollm2_prompts, greedy_reference):
    """SmolLM2 cut to four layers, and transformers' greedy outputs on it."""
    return smollm2_4_layers_dir, greedy_reference(smollm2_4_layers_dir, smollm2_prompts, MAX_NEW, batch=8)


def make_engine(model_dir, **knobs) -> LLMEngine:
    return LLMEngine(**{"dtype": "float32", "model": str(model_dir), "max_model_len": 1024, "kv_cache_memory_bytes": KV,
                        **knobs})


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_prompts_cover_short_to_long(smollm2_prompts):
    lengths = sorted(len(p) for p in smollm2_prompts)
    assert len(smollm2_prompts) == 16
    assert lengths[0] <= 5 and 550 <= lengths[-1] <= 700


def test_one_concurrent_batch(smollm2_dir, smollm2_prompts, expected, drive):
    engine = make_engine(smollm2_dir)
    assert tokens(drive(engine, smollm2_prompts, GREEDY)) == expected


def test_chunked_prefill_budget_32(cut, smollm2_prompts, drive):
    model_dir, expected = cut
    engine = make_engine(model_dir, max_num_batched_tokens=32, max_num_seqs=16)
    assert tokens(drive(engine, smollm2_prompts, GREEDY)) == expected


def test_small_pool_preempts(cut, smollm2_prompts, drive):
    model_dir, expected = cut
    per_block = ModelConfig.from_dir(model_dir).kv_bytes_per_token(torch.float32) * 16
    # 44 blocks: room for one request of max_model_len (704) tokens, far less than the batch needs
    engine = LLMEngine(dtype="float32", model=str(model_dir), max_model_len=704, kv_cache_memory_bytes=44 * per_block)
    assert tokens(drive(engine, smollm2_prompts, GREEDY)) == expected
    assert engine.stats().num_preemptions > 0


def test_shared_system_prompt_hits_prefix_cache(cut, smollm2_prompts, drive):
    model_dir, expected = cut
    engine = make_engine(model_dir)
    arrivals = {0: [0], 2: list(range(1, len(smollm2_prompts)))}
    assert tokens(drive(engine, smollm2_prompts, GREEDY, arrivals)) == expected
    assert engine.stats().prefix_cache_hits > 0


def test_requests_added_mid_decode(cut, smollm2_prompts, drive):
    model_dir, expected = cut
    engine = make_engine(model_dir)
    arrivals = {0: list(range(0, 16, 2)), 10: list(range(1, 16, 2))}
    assert tokens(drive(engine, smollm2_prompts, GREEDY, arrivals)) == expected


BF16_PREFIX = 8  # tokens that most bfloat16 outputs must share with float32's


def test_bfloat16_agrees_with_float32_on_the_first_tokens(smollm2_dir, smollm2_prompts, expected, drive):
    """bfloat16 keeps 8 significant bits of weights and activations, so a near-tie can flip a greedy pick,
    and the rest of that output then follows another path, as vLLM's bfloat16 does against its own float32
    (37 of W1's 64 outputs identical). Measured on these 16 prompts (Xeon, AMX): 15 share their first 9
    tokens with float32, 14 their first 14, 4 all 64; one flips its first token. On the AVX512-BF16 EPYC, with
    kvloom's own bfloat16 GEMM and the prefill kernel's dot products: 16 share 9, 15 share 14, 5 all 64.
    Held: 12 share 8."""
    first = SamplingParams(max_tokens=BF16_PREFIX, temperature=0)  # bfloat16 is emulated (slow) on AVX2-only CPUs
    got = tokens(drive(make_engine(smollm2_dir, dtype="bfloat16"), smollm2_prompts, first))
    agreeing = [g[:BF16_PREFIX] == e[:BF16_PREFIX] for g, e in zip(got, expected)]
    assert sum(agreeing) >= 12, agreeing


def test_the_q4_1_file_run_as_stored_gives_the_dequantized_float32_tokens(smollm2_dir, smollm2_prompts, expected,
                                                                           drive):
    """`quantization: gguf`: the embedded file's Q4_1 linears and Q8_0 head run by kvloom's quantized GEMM on the
    file's exact weights; in float32 every token is the de-quantized model's (issue 72's goal asks 90% of them)."""
    engine = make_engine(smollm2_dir, quantization="gguf")
    assert type(engine.decoder.layers[0].qkv).__name__ == "QuantizedLinear"
    assert tokens(drive(engine, smollm2_prompts, GREEDY)) == expected
