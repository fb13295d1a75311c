"""`quantization: gguf`: a GGUF model's linears run as the file stores them (kernels/quantized_linear.py, loaded by
engine/model/quantized_weights.py). The weights are the file's exactly, so in float32 an engine running them as
stored gives the de-quantized engine's tokens, and its logprobs to float32 rounding (the sums' order differs). A type
kvloom cannot run as stored is de-quantized, said once; models that did not come from a GGUF file, and tensor
parallelism, are refused at start by name. The embedded SmolLM2 file: tests/test_parity_smollm2.py."""

import logging

import pytest

from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.packed_linear import Layout
from kvloom.kernels.quantized_linear import QuantizedLinear, quant_kernel

PROMPTS = [[5, 60, 71, 200, 33], [100 + i for i in range(40)], [7] * 19]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)


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
    expected = run(LLMEngine(model=model, dtype="float32", max_model_len=128))
    engine = LLMEngine(model=model, dtype="float32", max_model_len=128, quantization="gguf")
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
    expected = run(LLMEngine(model=model, dtype="float32", max_model_len=128))
    with caplog.at_level(logging.INFO, logger="kvloom.engine.model.quantized_weights"):
        engine = LLMEngine(model=model, dtype="float32", max_model_len=128, quantization="gguf")
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
