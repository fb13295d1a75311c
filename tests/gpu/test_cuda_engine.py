"""The engine on a real CUDA device: Triton attention, the derived KV budget, half precision.

Skipped without CUDA (CI has none). On a GPU machine: `python -m pytest tests/gpu tests/test_triton_kernels.py`.
The CPU engine is the oracle: the same tiny checkpoint, the same prompts, greedy.
"""

import random
from pathlib import Path

import pytest
import torch

from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams

pytestmark = pytest.mark.host("cuda")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(count: int = 12, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 90))] for _ in range(count)]


def token_ids(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(batch, params)]


@pytest.fixture(scope="module")
def cpu_greedy(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24)
    return token_ids(llm, prompts())


def test_float32_engine_on_cuda_matches_the_cpu_engine(tiny_model_dir, cpu_greedy):
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 24)
    assert llm.engine.runner.backend.name == "triton"
    assert token_ids(llm, prompts()) == cpu_greedy


def test_chunked_prefill_preemption_and_prefix_hits_stay_exact_on_cuda(tiny_model_dir, cpu_greedy):
    # 24 blocks of 16 tokens for 12 requests of up to 113 tokens: the scheduler must preempt; chunks
    # of 32 tokens split every long prompt; the second round hits the prefix cache.
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", block_size=16,
              kv_cache_memory_bytes=24 * 16 * llm_bytes_per_token(tiny_model_dir, torch.float32),
              max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128)
    assert token_ids(llm, prompts()) == cpu_greedy
    assert token_ids(llm, prompts()) == cpu_greedy
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"


def llm_bytes_per_token(model_dir, dtype: torch.dtype) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def test_auto_dtype_is_bfloat16_and_agrees_with_float32_on_first_tokens(tiny_model_dir, cpu_greedy):
    llm = LLM(str(tiny_model_dir), device="cuda", kv_cache_memory_bytes=1 << 24)
    assert llm.engine.dtype == torch.bfloat16
    outputs = token_ids(llm, prompts())
    first_four_equal = sum(out[:4] == ref[:4] for out, ref in zip(outputs, cpu_greedy))
    assert first_four_equal >= 10, f"bf16 agreed with fp32 on the first 4 tokens of {first_four_equal}/12 prompts"


def test_derived_kv_budget_fits_the_memory_utilization_target(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    total = torch.cuda.get_device_properties(0).total_memory
    held = torch.cuda.memory_allocated(0)
    assert llm.engine.num_blocks > 0
    assert 0.2 * total < held <= 0.3 * total, f"holds {held / total:.2f} of the device"
    del llm
    torch.cuda.empty_cache()


def test_seeded_sampling_reproduces_on_cuda(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cuda", kv_cache_memory_bytes=1 << 24)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    assert token_ids(llm, prompts(4), params) == token_ids(llm, prompts(4), params)


def test_seeded_sampled_requests_draw_the_same_tokens_on_cuda_as_on_cpu(tiny_model_dir):
    """Counter-based draws: a seeded request's i-th uniform is (seed, i) on any device, so float32 logits that
    agree to rounding give the same tokens (a uniform landing within rounding of a boundary would differ:
    rare over these 12 x 24 draws)."""
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_k=0 if i % 2 else 40, top_p=1.0 if i % 3 else 0.9,
                             seed=i, ignore_eos=True) for i in range(12)]
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tiny_model_dir), device=device, dtype="float32", kv_cache_memory_bytes=1 << 24)
        runs[device] = [out.outputs[0].token_ids for out in llm.generate(prompts(), params)]
    assert runs["cuda"] == runs["cpu"]


def test_decode_graphs_replay_what_eager_steps_compute(tiny_model_dir, cpu_greedy):
    """Graphs on (the default on CUDA), graphs off and the CPU engine: the same greedy tokens, float32. 12 prompts
    with max_num_seqs 16: batches of 12 down to 1 replay the graphs of 16, 8, 4, 2 and 1 rows, padded."""
    eager = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 24,
                max_num_seqs=16, enforce_eager=True)
    graphed = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 24,
                  max_num_seqs=16)
    assert eager.engine.runner.graphs is None and graphed.engine.runner.graphs.sizes == [1, 2, 4, 8, 16]
    assert token_ids(graphed, prompts()) == token_ids(eager, prompts()) == cpu_greedy


def waits_for_the_device(call) -> list[str]:
    """Where `call()` waits for the device (file:line of each wait): torch's sync debug mode warns at each."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def test_sampling_and_verification_wait_for_the_device_once_a_step():
    """Every row's draw and every draft's verdict are made on the device, from host tensors sent through pinned
    memory; a step's tokens come back in one copy (issue 74: the rejection sampler waited per row and draft). The
    verified tokens are the CPU's (counter-based draws, float32 logits)."""
    from kvloom.engine.counter_draws import seed_words
    from kvloom.engine.request import Request
    from kvloom.engine.sampler import sample
    from kvloom.engine.speculation.rejection_sampler import verify

    def step(device: str) -> list[Request]:
        def request(params, drafts=(), probs=None, seed=0):
            r = Request("r", [1, 2, 3], params, draw_seed=seed_words(seed))
            r.spec_token_ids, r.spec_probs = list(drafts), None if probs is None else probs.to(device)
            return r

        return [request(SamplingParams(temperature=0), [4, 6, 2]),
                request(SamplingParams(temperature=0.9, top_k=10), [7, 8], seed=1),
                request(SamplingParams(temperature=1.1, top_p=0.8), [1, 2, 3], draft_probs, seed=2),
                request(SamplingParams(temperature=0.7), seed=3), request(SamplingParams(temperature=0), seed=4)]

    torch.manual_seed(0)
    vocab = 1000
    draft_probs = torch.softmax(torch.randn(3, vocab), -1)
    logits = torch.randn(13, vocab)  # the rows: 4, 3, 4, 1 and 1
    for row, token in [(0, 4), (1, 6), (4, 7), (7, 1)]:
        logits[row, token] += 6
    on_cuda = logits.cuda()
    verify(on_cuda, step("cuda"))  # warm: the pinned host allocator, the kernels
    requests = step("cuda")  # the draft's probabilities on the device before the step, as a drafter leaves them
    waits = waits_for_the_device(lambda: verify(on_cuda, requests))
    assert len(waits) == 1, waits
    ids = [[t.token_id for t in kept] for kept in verify(on_cuda, step("cuda"))]
    assert ids == [[t.token_id for t in kept] for kept in verify(logits, step("cpu"))]
    plain = [Request("p", [1], SamplingParams(temperature=t, top_p=0.9), draw_seed=seed_words(i))
             for i, t in enumerate([0, 0.8, 1.2])]
    waits = waits_for_the_device(lambda: sample(on_cuda[:3], plain))
    assert len(waits) == 1, waits


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_cuda_draws_what_the_cpu_engine_draws(tiny_model_dir, method):
    """Greedy and seeded sampled requests, drafted by prompt lookup (point masses, mostly refused by this random
    model) or by the target itself as a draft model (all kept): the CUDA engine, verifying on the device and keeping
    its block tables from step to step, gives the CPU engine's tokens and counts."""
    spec = {"method": method, "num_speculative_tokens": 3,
            **({"model": str(tiny_model_dir)} if method == "draft_model" else
               {"prompt_lookup_min": 1, "prompt_lookup_max": 3})}
    batch = [p[:8] * 4 for p in prompts(12)]
    params = [SamplingParams(max_tokens=24, temperature=0 if i % 3 == 0 else 0.9, top_k=40, seed=i, ignore_eos=True)
              for i in range(12)]
    runs, stats = {}, {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tiny_model_dir), device=device, dtype="float32", kv_cache_memory_bytes=1 << 24,
                  speculative_config=spec)
        runs[device] = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
        stats[device] = llm.engine.spec_decode_stats
    assert runs["cuda"] == runs["cpu"]
    assert stats["cuda"].num_draft_tokens > 0 and stats["cuda"] == stats["cpu"]


def test_kv_tier_blocks_load_into_a_cuda_pool_as_computed(tiny_model_dir, tmp_path):
    """A CUDA engine started after another wrote the prompts' blocks to the host tier loads them (pinned staging,
    copied on the tier worker's stream) and generates what a CPU engine computes."""
    batch = [p * 3 for p in prompts(4, seed=5)]
    tiers = {"host_bytes": 64 << 20, "host_path": str(tmp_path / "host")}
    cpu = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24)
    expected = token_ids(cpu, batch)
    writer = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 24, kv_tiers=tiers)
    assert token_ids(writer, batch) == expected
    writer.engine.kv.tier_io.drain()
    reader = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 24, kv_tiers=tiers)
    assert token_ids(reader, batch) == expected
    assert reader.engine.stats().kv_tiers["host"]["hits"] > 0
    assert reader.engine.kv.tiers.copy.buffer.is_pinned()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_gguf_linears_run_as_stored_by_the_triton_kernel_give_the_cpu_engines_tokens(tiny_gguf, arch):
    """`quantization: gguf` on CUDA: every linear the file stores as Q8_0 / Q4_1 runs in the Triton kernel, and the
    greedy float32 tokens and logprobs are the CPU engine's (kvloom's CPU quantized GEMM on the same blocks)."""
    from kvloom.kernels.packed_linear import Layout

    model = tiny_gguf(arch)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model, device=device, dtype="float32", max_model_len=128, quantization="gguf")
        if device == "cuda":
            layer = llm.engine.decoder.layers[0]
            assert {layer.qkv.layout, layer.gate_up.layout, layer.down.layout,
                    llm.engine.decoder.lm_head.layout} == {Layout.TRITON_QUANTIZED}
        outputs[device] = [o.outputs[0] for o in llm.generate(prompts(6, vocab=250), params)]
    for cpu, cuda in zip(outputs["cpu"], outputs["cuda"]):
        assert cuda.token_ids == cpu.token_ids
        assert [lp[t] for t, lp in zip(cuda.token_ids, cuda.logprobs)] == pytest.approx(
            [lp[t] for t, lp in zip(cpu.token_ids, cpu.logprobs)], abs=1e-4)


def test_fp8_weights_on_the_tensor_cores_compute_what_the_cpu_reference_does(tiny_model_dir, monkeypatch):
    """`quantization: fp8` (kernels/fp8_linear.py): the same quantized operands on CUDA's FP8 tensor cores as on
    torch's CPU reference (tests/test_fp8_weights.py holds that to float64), and an engine on each (the CPU one with
    the device check lifted): the same greedy tokens, but where sums in another order flip a near-tie."""
    from kvloom.engine.model import model_loader
    from kvloom.kernels.fp8_linear import Fp8Linear, fp8_unsupported

    if (why := fp8_unsupported(torch.device("cuda"))) is not None:
        pytest.skip(why)
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(256, 512, generator=generator) / 16, torch.randn(33, 512, generator=generator)
    on_cpu, on_cuda = Fp8Linear.pack(weight.bfloat16()), Fp8Linear.pack(weight.bfloat16().cuda())
    assert torch.equal(on_cpu.weight.float(), on_cuda.weight.float().cpu())
    torch.testing.assert_close(on_cuda(x.bfloat16().cuda()).float().cpu(), on_cpu(x.bfloat16()).float(),
                               atol=1e-2, rtol=2 ** -7)  # sums in another order, each rounded once to bfloat16
    runs = {}
    for device in ("cuda", "cpu"):
        if device == "cpu":
            monkeypatch.setattr(model_loader, "fp8_unsupported", lambda _: None)
        llm = LLM(str(tiny_model_dir), device=device, dtype="bfloat16", quantization="fp8",
                  kv_cache_memory_bytes=1 << 24)
        assert isinstance(llm.engine.decoder.layers[0].gate_up, Fp8Linear)
        runs[device] = token_ids(llm, prompts())
    first_four_equal = sum(out[:4] == ref[:4] for out, ref in zip(runs["cuda"], runs["cpu"]))
    assert first_four_equal >= 10, f"CUDA and CPU agreed on the first 4 tokens of {first_four_equal}/12 prompts"
