"""Tensor parallelism over NCCL on two real GPUs: the same code as the gloo tests, on CUDA.

Skipped without two CUDA devices (CI has none). On a GPU machine: `./dev.sh test tests/gpu`. The one-GPU engine is
the oracle: SmolLM2, 12 prompts, greedy, float32 (bfloat16 would let the split's reduction order part near-ties).
"""

import pytest
import torch

from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams

pytestmark = pytest.mark.host("two-cuda")

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
KNOBS = {"device": "cuda", "dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20}


def test_two_gpus_over_nccl_generate_what_one_does(smollm2_prompts):
    prompts = smollm2_prompts[4:]
    one = LLM(**KNOBS)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    two = LLM(**KNOBS, tensor_parallel_size=2)
    try:
        assert [r.placement for r in two.engine.runner.reports][1].startswith("local process")
        assert two.engine.runner.kv_caches[0][0].device == torch.device("cuda", 0)
        assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)] == expected
        assert two.engine.runner.group.calls["all-reduce"] > 0
    finally:
        two.engine.shutdown()
