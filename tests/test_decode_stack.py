"""A decode-only CPU step's layers run in one C++ call (engine/model/decode_stack.py), which calls the Python layer
loop's own ops in its order: the same hidden states and K/V bit for bit, for every way a linear runs (kvloom's
blocked kernel, oneDNN's packed or shared layout, dense, GGUF blocks as stored, int8 activations), with LoRA rows of
several adapters, for the first layers only (layer-skip drafting), and through an engine's whole generation. Steps
with prompt chunks keep the loop."""

import pytest
import torch

from kvloom.benchmarks.random_weights import write_random_adapter
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.attention import ForwardContext
from kvloom.engine.model.decode_stack import DecodeStack
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels import packed_linear
from kvloom.kernels.metadata import AttentionMetadata
from kvloom.kernels.packed_linear import Layout, blocked_kernel_built
from kvloom.kernels.quantized_linear import quant_kernel

POOL = 1 << 24  # KV bytes: room for these prompts (zeroing the default 2 GiB costs every engine ~0.2 s)
PROMPTS = [[5, 60, 71, 200, 33], [100 + i for i in range(40)], [7] * 19]
SAMPLING = SamplingParams(max_tokens=10, temperature=0, logprobs=3, ignore_eos=True)
DTYPES = ["float32", "bfloat16"]


def layout_runs(layout: Layout, dtype: str) -> bool:
    if layout is Layout.BLOCKED:
        return blocked_kernel_built(getattr(torch, dtype))
    if layout in (Layout.ONEDNN, Layout.SHARED):
        return torch.backends.mkldnn.is_available()
    return True


def dense_engine(model_dir, dtype: str, layout: Layout, monkeypatch) -> LLMEngine:
    """An engine on `model_dir` whose every packed linear takes `layout`."""
    if not layout_runs(layout, dtype):
        pytest.skip(f"{layout.value} does not run {dtype} on this host")
    monkeypatch.setattr(packed_linear, "host_layout", lambda weight, shared=False: layout)
    return LLMEngine(model=str(model_dir), dtype=dtype, block_size=4, kv_cache_memory_bytes=POOL)


def quantized_engine(tiny_gguf, dtype: str, quantization: str) -> LLMEngine:
    if quant_kernel() is None:
        pytest.skip("the quantized CPU kernel is not built here")
    return LLMEngine(model=tiny_gguf(), dtype=dtype, block_size=4, kv_cache_memory_bytes=POOL,
                     quantization=quantization)


def decode_step(engine: LLMEngine, num_layers: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step of two requests (7 and 5 tokens of context) over caches of seeded random K/V: the hidden
    states and every cache after it."""
    runner = engine.runner
    generator = torch.Generator().manual_seed(0)
    for cache in (tensor for layer in runner.kv_caches for tensor in layer):
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    meta = AttentionMetadata.build([1, 1], [7, 5], [[0, 1], [2, 3]], 4, torch.device("cpu"))
    context = ForwardContext(meta, runner.kv_caches, runner.backend)
    hidden = engine.decoder(torch.tensor([13, 200]), torch.tensor([6, 4]), context, num_layers=num_layers)
    return hidden, [tensor.clone() for layer in runner.kv_caches for tensor in layer]


class CountingStack:
    """The decoder's stack, counting the steps it ran."""

    def __init__(self, stack: DecodeStack) -> None:
        self.stack, self.calls = stack, 0

    def runs(self, *args) -> bool:
        return self.stack.runs(*args)

    def __call__(self, *args) -> torch.Tensor:
        self.calls += 1
        return self.stack(*args)


def assert_stack_matches_the_loop(engine: LLMEngine) -> None:
    decoder = engine.decoder
    assert decoder.stack is not None
    stack = CountingStack(decoder.stack)
    for num_layers in (None, 1):  # the whole model, and the first layer only (layer-skip drafting)
        decoder.stack = stack
        ours, our_caches = decode_step(engine, num_layers)
        decoder.stack = None
        loops, loop_caches = decode_step(engine, num_layers)
        assert torch.equal(ours, loops)
        assert all(torch.equal(a, b) for a, b in zip(our_caches, loop_caches))
    decoder.stack = stack.stack
    assert stack.calls == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [Layout.BLOCKED, Layout.ONEDNN, Layout.SHARED, Layout.DENSE])
def test_the_stack_gives_the_layer_loops_bits_for_each_dense_layout(tiny_model_dir, monkeypatch, layout, dtype):
    engine = dense_engine(tiny_model_dir, dtype, layout, monkeypatch)
    assert {linear.layout for linear in (engine.decoder.layers[0].qkv, engine.decoder.layers[0].down)} == {layout}
    assert_stack_matches_the_loop(engine)


@pytest.mark.parametrize("dtype,quantization", [("float32", "gguf"), ("bfloat16", "gguf"), ("bfloat16", "gguf-int8")])
def test_the_stack_gives_the_layer_loops_bits_for_gguf_blocks_run_as_stored(tiny_gguf, dtype, quantization):
    assert_stack_matches_the_loop(quantized_engine(tiny_gguf, dtype, quantization))


def generate(engine: LLMEngine, stack: DecodeStack | None, adapters: list[str | None] = (None, None, None)) -> list:
    """Greedy tokens and top-3 logprobs of PROMPTS (under `adapters`) on a fresh engine, the third joining while the
    others decode."""
    engine.decoder.stack = stack
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt, SAMPLING, lora=adapters[i])
    outputs, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            engine.add_request("r2", PROMPTS[2], SAMPLING, lora=adapters[2])
        outputs |= {out.request_id: out.outputs[0] for out in engine.step() if out.finished}
    return [(outputs[f"r{i}"].token_ids, outputs[f"r{i}"].logprobs) for i in range(3)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_engine_generates_the_same_tokens_and_logprobs_with_the_stack_as_with_the_loop(tiny_gguf, dtype):
    engine = quantized_engine(tiny_gguf, dtype, "gguf")
    stack = CountingStack(engine.decoder.stack)
    with_stack = generate(engine, stack)
    assert stack.calls >= SAMPLING.max_tokens - 2  # the steps where every row decodes
    assert with_stack == generate(quantized_engine(tiny_gguf, dtype, "gguf"), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_rows_of_two_adapters_and_the_base_get_the_loops_deltas(tiny_model_dir, tmp_path, dtype):
    config = ModelConfig.from_dir(tiny_model_dir)
    adapters = {name: str(write_random_adapter(tmp_path / name, config, rank, seed=seed, targets=targets))
                for seed, (name, rank, targets) in enumerate([("qv", 4, ("q_proj", "v_proj")),
                                                              ("all", 8, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"))])}

    def engine() -> LLMEngine:
        return LLMEngine(model=str(tiny_model_dir), dtype=dtype, block_size=4, kv_cache_memory_bytes=POOL,
                         lora={"adapters": adapters, "max_loras": 2})

    ours = engine()
    stack = CountingStack(ours.decoder.stack)
    with_stack = generate(ours, stack, ["all", None, "qv"])
    assert stack.calls >= SAMPLING.max_tokens - 2
    assert with_stack == generate(engine(), None, ["all", None, "qv"])


def test_steps_with_prompt_chunks_or_more_rows_than_an_mlp_pass_keep_the_loop(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=POOL)
    runner, stack = engine.runner, engine.decoder.stack
    decode = AttentionMetadata.build([1, 1], [7, 5], [[0, 1], [2, 3]], 4, torch.device("cpu"))
    chunk = AttentionMetadata.build([1, 3], [7, 5], [[0, 1], [2, 3]], 4, torch.device("cpu"))
    assert stack.runs(ForwardContext(decode, runner.kv_caches, runner.backend), 2, 512)
    assert not stack.runs(ForwardContext(chunk, runner.kv_caches, runner.backend), 4, 512)
    assert not stack.runs(ForwardContext(decode, runner.kv_caches, runner.backend), 2, 1)  # over one MLP pass
