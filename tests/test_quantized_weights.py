"""`quantization: gguf`: a GGUF model's linears run as the file stores them (kernels/quantized_linear.py, loaded by
engine/model/quantized_weights.py). The weights are the file's exactly, so in float32 an engine running them as
stored gives the de-quantized engine's tokens, and its logprobs to float32 rounding (the sums' order differs). A type
kvloom cannot run as stored is de-quantized, said once; LoRA adapters and speculation work over a quantized base;
models that did not come from a GGUF file, and tensor parallelism, are refused at start by name. The embedded
SmolLM2 file: tests/test_parity_smollm2.py."""

import logging

import pytest

from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.packed_linear import Layout
from kvloom.kernels.quantized_linear import QuantizedLinear, int8_dots, quant_kernel

PROMPTS = [[5, 60, 71, 200, 33], [100 + i for i in range(40)], [7] * 19]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
POOL = 1 << 24  # KV bytes: room for these prompts (zeroing the default 2 GiB costs every engine ~0.2 s)


def run(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    done = {}
    while engine.has_unfinished():
        done |= {out.request_id: out.outputs[0] for out in engine.step() if out.finished}
    return [(done[f"r{i}"].token_ids, [lp[t] for t, lp in zip(done[f"r{i}"].token_ids, done[f"r{i}"].logprobs)])
            for i in range(len(PROMPTS))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_linears_run_as_stored_give_the_dequantized_engines_tokens_and_logprobs(tiny_gguf, arch):
    model = tiny_gguf(arch)
    expected = run(LLMEngine(model=model, dtype="float32", max_model_len=128, kv_cache_memory_bytes=POOL))
    engine = LLMEngine(model=model, dtype="float32", max_model_len=128, kv_cache_memory_bytes=POOL, quantization="gguf")
    layer = engine.decoder.layers[0]
    assert isinstance(layer.qkv, QuantizedLinear) and layer.qkv.qtype.name == "Q8_0"
    assert layer.gate_up.qtype.name == "Q4_1" and layer.down.qtype.name == "Q8_0"
    assert isinstance(engine.decoder.lm_head, QuantizedLinear)  # untied: the file's Q4_1 output weight
    if quant_kernel() is not None:
        assert layer.qkv.layout is Layout.QUANTIZED
    got = run(engine)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_a_type_kvloom_cannot_run_as_stored_is_dequantized_and_said_once(tiny_gguf, caplog):
    model = tiny_gguf("llama", down_type="F16")
    expected = run(LLMEngine(model=model, dtype="float32", max_model_len=128, kv_cache_memory_bytes=POOL))
    with caplog.at_level(logging.INFO, logger="kvloom.engine.model.quantized_weights"):
        engine = LLMEngine(model=model, dtype="float32", max_model_len=128, kv_cache_memory_bytes=POOL,
                           quantization="gguf")
    said = [r.getMessage() for r in caplog.records if "de-quantized" in r.getMessage()]
    assert len(said) == 1 and "F16" in said[0]
    assert not isinstance(engine.decoder.layers[0].down, QuantizedLinear)
    assert isinstance(engine.decoder.layers[0].gate_up, QuantizedLinear)
    assert [tokens for tokens, _ in run(engine)] == [tokens for tokens, _ in expected]


def test_a_model_not_from_a_gguf_file_or_split_over_ranks_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ConfigError, match="quantization"):
        LLMEngine(model=str(tiny_model_dir), quantization="gguf")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, quantization="gguf")


def test_lora_adapters_on_a_quantized_base_give_the_dequantized_bases_tokens(tiny_gguf, tmp_path):
    """QLoRA's serving case: adapters over linears run as stored compute what they compute over the de-quantized
    base, rows of two adapters and the base in one batch."""
    from kvloom.benchmarks.random_weights import write_random_adapter
    from kvloom.engine.model.model_config import ModelConfig
    from kvloom.engine.model.model_files import resolve_model_dir

    model = tiny_gguf("llama")
    config = ModelConfig.from_dir(resolve_model_dir(model))
    adapters = {"attn": str(write_random_adapter(tmp_path / "attn", config, 4, seed=1, targets=("q_proj", "v_proj"))),
                "mlp": str(write_random_adapter(tmp_path / "mlp", config, 8, seed=2,
                                                targets=("gate_proj", "up_proj", "down_proj", "o_proj")))}
    names = [None, "attn", "mlp"]

    def run_with_adapters(**knobs) -> list[tuple[list[int], list[float]]]:
        engine = LLMEngine(model=model, dtype="float32", max_model_len=128, kv_cache_memory_bytes=POOL,
                           lora={"adapters": adapters}, **knobs)
        for i, (prompt, name) in enumerate((p, n) for p in PROMPTS for n in names):
            engine.add_request(f"r{i}", prompt, GREEDY, lora=name)
        done = {}
        while engine.has_unfinished():
            done |= {out.request_id: out.outputs[0] for out in engine.step() if out.finished}
        return [(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)])
                for o in (done[f"r{i}"] for i in range(len(done)))]

    expected = run_with_adapters()
    got = run_with_adapters(quantization="gguf")
    by_name = {name: [tokens for tokens, _ in expected[i::len(names)]] for i, name in enumerate(names)}
    assert by_name["attn"] != by_name[None] and by_name["mlp"] != by_name[None]  # each adapter changes the output
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected):
        assert ours == pytest.approx(theirs, abs=1e-4)


@pytest.mark.parametrize("dtype,quantization", [("float32", "gguf"), ("bfloat16", "gguf-int8")])
@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model"])
def test_speculation_on_a_quantized_base_keeps_its_greedy_tokens(tiny_gguf, method, dtype, quantization):
    """Drafts proposed for (and, with a draft model, by) a base run as stored are verified by it: greedy output is
    the base's own without speculation, with int8 activations too (a row's int8 result is the same at any row
    count)."""
    model = tiny_gguf("llama")
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 1},
            "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": model}}[method]
    quantized = {"model": model, "dtype": dtype, "max_model_len": 128, "kv_cache_memory_bytes": POOL,
                 "quantization": quantization}
    expected = run(LLMEngine(**quantized))
    engine = LLMEngine(**quantized, speculative_config=spec)
    got = run(engine)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert engine.spec_decode_stats.num_accepted_tokens > 0


def test_int8_activations_are_asked_for_by_name_and_reach_every_quantized_linear(tiny_gguf):
    """`quantization: gguf-int8` sets every linear run as stored to take bfloat16 activations in int8 where the CPU
    has VNNI (kernels: tests/test_quantized_linear.py); `gguf` leaves them exact. Both serve the same requests."""
    model = tiny_gguf("llama")
    for quantization, int8 in (("gguf", False), ("gguf-int8", True)):
        engine = LLMEngine(model=model, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=POOL,
                           quantization=quantization)
        layer = engine.decoder.layers[0]
        linears = (layer.qkv, layer.gate_up, layer.down, engine.decoder.lm_head)
        assert [linear.int8 for linear in linears] == [int8 and int8_dots()] * 4
        assert [len(tokens) for tokens, _ in run(engine)] == [GREEDY.max_tokens] * len(PROMPTS)
