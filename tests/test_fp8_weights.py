"""`quantization: fp8` (kernels/fp8_linear.py): a 16-bit checkpoint's layer linears quantized at load to float8 with a
scale an output, activations a scale a row on each call, multiplied by `torch._scaled_mm`. The arithmetic is that
product of the two quantized operands, float32 sums rounded once to bfloat16, and within float8's rounding of the
unquantized product; an engine runs every layer linear so (its LM head in bfloat16) and scores text close to the
bfloat16 engine (within 10% of its loss: float8 costs SmolLM2 4%); devices without FP8 tensor cores are refused by name. The CUDA run:
tests/gpu/test_cuda_engine.py."""

import pytest
import torch

from kvloom.engine.errors import ConfigError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model import decoder, model_loader
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.fp8_linear import FP8, FP8_MAX, Fp8Linear, fp8_unsupported, quantize_rows

E4M3_STEP = 2.0 ** -3  # float8_e4m3fn keeps 3 mantissa bits: a value rounds within half a step of its size
TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. The early bird catches the worm, "
        "but the second mouse gets the cheese. All that glitters is not gold; still, a penny saved is a penny earned.")


def test_each_rows_largest_value_maps_to_448_and_the_rest_round_within_half_a_step():
    t = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1e-3], [1.0], [30.0], [1e3],
                                                                                      [7.0]])
    quantized, scale = quantize_rows(t)
    assert quantized.dtype == FP8 and scale.shape == (5, 1)
    assert torch.equal(quantized.float().abs().amax(dim=1), torch.full((5,), FP8_MAX))
    back = quantized.float() * scale
    normal = t.abs() >= 2.0 ** -6 * scale  # float8's normal range (subnormals round to a fixed step)
    assert torch.all(((back - t).abs() <= E4M3_STEP / 2 * t.abs() * 1.0001)[normal])


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_an_fp8_linear_is_the_product_of_its_quantized_operands(rows, dtype, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(48, 128, generator=generator) / 8).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    linear = Fp8Linear.pack(weight, bias)
    assert linear.weight.dtype == FP8 and linear.out_features == 48
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, 48)
    x8, x_scale = quantize_rows(x)
    w8 = linear.weight.double() * linear.scale.double().t()
    exact = (x8.double() * x_scale.double()) @ w8.t()
    magnitude = (x8.double() * x_scale.double()).abs() @ w8.abs().t()
    # float32 sums (1e-5 of the magnitude), one rounding to bfloat16 (2^-8), the bias added in x's dtype after
    ours = y.double() - (0 if bias is None else bias.double())
    total = exact + (0 if bias is None else bias.double())
    bound = 1e-5 * magnitude + 2.0 ** -8 * exact.abs() + (0 if bias is None else 2.0 ** -8 * total.abs())
    assert torch.all((ours - exact).abs() <= bound + 1e-12)
    # and within float8's rounding of both operands of the unquantized product
    full = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    full_magnitude = x.double().abs() @ weight.double().abs().t()
    assert torch.all((y.double() - full).abs() <= E4M3_STEP * 1.01 * full_magnitude + bound + 1e-12)


def test_devices_without_fp8_tensor_cores_are_refused_by_name(monkeypatch, tiny_model_dir):
    assert "tensor cores" in fp8_unsupported(torch.device("cpu"))
    with pytest.raises(ConfigError, match="quantization.*FP8 tensor cores"):
        LLMEngine(model=str(tiny_model_dir), dtype="bfloat16", quantization="fp8", kv_cache_memory_bytes=1 << 24)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert "NVIDIA A100 is 8.0" in fp8_unsupported(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_unsupported(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="quantization: not with tensor_parallel_size"):
        LLMEngine(model=str(tiny_model_dir), quantization="fp8", tensor_parallel_size=2)


def test_linears_whose_shape_float8_cannot_take_keep_the_models_dtype_and_one_log_line_names_them(
        monkeypatch, caplog, tiny_model_dir):
    monkeypatch.setattr(model_loader, "fp8_unsupported", lambda device: None)
    monkeypatch.setattr(decoder, "runs_in_fp8", lambda weight: weight.shape[1] != 128)  # the MLP's down projection
    with caplog.at_level("INFO", logger=decoder.__name__):
        engine = LLMEngine(model=str(tiny_model_dir), dtype="bfloat16", quantization="fp8",
                           kv_cache_memory_bytes=1 << 24)
    layer = engine.decoder.layers[0]
    assert not isinstance(layer.down, Fp8Linear) and isinstance(layer.gate_up, Fp8Linear)
    lines = [r.getMessage() for r in caplog.records if "quantization fp8" in r.getMessage()]
    assert lines == ["quantization fp8: down keep the model's dtype (float8 GEMMs take dims that are multiples of 16)"]


def text_logprobs(engine: LLMEngine) -> list[float]:
    """The logprob of each of TEXT's tokens after the first, teacher-forced (prompt logprobs)."""
    engine.add_request("text", TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in engine.step() if out.finished]
    ids = outputs[0].prompt_token_ids
    return [entry[token] for (_, entry), token in zip(outputs[0].prompt_logprobs[1:], ids[1:])]


def test_an_fp8_engine_scores_text_as_the_bfloat16_engine_does_within_float8s_error(monkeypatch,
                                                                                     smollm2_dir):
    """SmolLM2, on torch's CPU FP8 multiply (the device check
    lifted: the kernel's arithmetic is the test above's, the engine's plumbing this one's)."""
    knobs = {"model": str(smollm2_dir), "dtype": "bfloat16", "max_model_len": 256,
             "kv_cache_memory_bytes": 1 << 26}
    reference = text_logprobs(LLMEngine(**knobs))
    monkeypatch.setattr(model_loader, "fp8_unsupported", lambda device: None)
    engine = LLMEngine(**knobs, quantization="fp8")
    layer = engine.decoder.layers[0]
    assert all(isinstance(linear, Fp8Linear) for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert not isinstance(engine.decoder.lm_head, Fp8Linear)
    ours = text_logprobs(engine)
    assert ours != reference  # the linears did run in float8
    # measured: a token's logprob moves 0.42 nats on average and the mean loss 3.25 -> 3.38 nats (+4%): float8's
    # 3 mantissa bits cost a 135M model that much; a wrong scale or a lost bias costs whole nats a token
    mean_shift = sum(abs(a - b) for a, b in zip(ours, reference)) / len(ours)
    nll, reference_nll = -sum(ours) / len(ours), -sum(reference) / len(reference)
    assert mean_shift < 0.6 and abs(nll - reference_nll) < 0.1 * reference_nll, (mean_shift, nll, reference_nll)
