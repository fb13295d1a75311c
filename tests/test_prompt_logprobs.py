"""Prompt logprobs: each prompt token's logprob equals transformers' log-softmax over the prompt (float32, a tiny
random Llama), whether the prompt is computed whole, in chunks of a few tokens, after the same prompt filled the
prefix cache (a request that asks computes its prompt again), or over two tensor-parallel ranks; ranks are exact;
requests that do not ask get none."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: row p scores the token after position p."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunks-of-8"])
def test_prompt_logprobs_equal_transformers_whole_chunked_and_after_a_prefix_cache_hit(tiny_model_dir, expected,
                                                                                      chunk):
    knobs = {"max_num_batched_tokens": chunk, "max_num_seqs": 4} if chunk else {}
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, **knobs)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0].prompt_logprobs is None
    for wanted in (1, 3):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=wanted))[0]
        assert out.num_cached_tokens == 0  # the same prompt was cached: this request computed it again
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        for position in range(1, len(PROMPT)):
            rank, entry = out.prompt_logprobs[position]
            row, token = expected[position - 1], PROMPT[position]
            assert next(iter(entry)) == token and entry[token] == pytest.approx(row[token].item(), abs=1e-4)
            assert rank == int((row > row[token]).sum()) + 1
            top = row.topk(wanted)
            for value, alternative in zip(top.values.tolist(), top.indices.tolist()):
                assert entry[alternative] == pytest.approx(value, abs=1e-4)
            assert len(entry) == wanted + (token not in top.indices.tolist())  # the token and its top alternatives


def test_prompt_logprobs_with_tensor_parallelism_equal_transformers(tiny_model_dir, expected):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256,
              tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        rank, entry = out.prompt_logprobs[position]
        row, token = expected[position - 1], PROMPT[position]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        assert rank == int((row > row[token]).sum()) + 1
