"""Integer checkpoints as quantizers write them, from a tiny random Llama: compressed-tensors (llm-compressor's format,
which vLLM runs: W4A16, W8A16, W8A8), written by the compressed-tensors library itself; AutoAWQ's 4-bit gemm format,
whose reference is that library's own AutoAWQ converter; and GPTQ's (formats gptq and gptq_v2), holding the integers
of such a library-written checkpoint, whose de-quantization is the reference, its packing pinned by known answers
from GPTQModel's code (all written, and the library's references computed, in a process of their own: the library
imports triton, which Triton's interpreter tests here must import first). kvloom reads them without it
(engine/model/compressed_tensors.py, awq.py, gptq.py): every linear reads as the library's own de-quantization,
computed in float64, and runs as GGUF blocks in kvloom's quantized GEMM (engine/model/integer_weights.py;
tests/test_quantized_linear.py checks that GEMM against de-quantize-then-matmul for each block type), so an engine on
the checkpoint gives the tokens of an engine on its de-quantized weights. What kvloom cannot hold as blocks runs
de-quantized, said once; what it cannot read at all, and `quantization` values that contradict the checkpoint, are
refused by name."""

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvloom.engine.errors import ConfigError, ModelLoadError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.integer_weights import IntegerCheckpoint
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.model_loader import open_checkpoint
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.gguf_blocks import dequantize
from kvloom.kernels.quantized_linear import QuantizedLinear, int8_dots


# scheme, group size, the GGUF block type kvloom holds it in
SCHEMES = {"W4A16": (32, "Q4_0"), "W4A16_ASYM": (64, "Q4_1"), "W8A16": (None, "Q8_0"), "W8A8": (None, "Q8_0"),
           "AWQ": (32, "Q4_1"), "GPTQ": (32, "Q4_0"), "GPTQ_ASYM": (64, "Q4_1"), "GPTQ_8BIT": (None, "Q8_0")}
# GPTQ checkpoints: the compressed-tensors scheme whose integers they hold, and their format (gptq: AutoGPTQ's)
GPTQ = {"GPTQ": ("W4A16", "gptq"), "GPTQ_ASYM": ("W4A16_ASYM", "gptq"), "GPTQ_8BIT": ("W8A16", "gptq_v2")}
ZERO_POINTS = ("W4A16_ASYM", "AWQ", "GPTQ_ASYM")  # Q4_1 blocks: their mins rounded to float16
PROMPTS = [[5, 60, 71, 200, 33], [100 + i for i in range(40)], [7] * 19]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
POOL = 1 << 24  # KV bytes: room for these prompts


def write_checkpoints(jobs: list[dict]) -> None:
    """benchmarks/compressed_checkpoint.py's writers, in a process of their own (the library imports triton)."""
    done = subprocess.run([sys.executable, "-m", "kvloom.benchmarks.compressed_checkpoint", json.dumps(jobs)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def compressed(tiny_model_dir, tmp_path_factory):
    """scheme -> a checkpoint of the tiny model (16-bit scales, as the quantizers save them)."""
    root = tmp_path_factory.mktemp("compressed")
    jobs = [{"model_dir": str(tiny_model_dir), "target": str(root / scheme), "scheme": scheme,
             "group_size": group or 128} for scheme, (group, _) in SCHEMES.items() if scheme not in GPTQ]
    jobs += [{"model_dir": str(tiny_model_dir), "target": str(root / scheme), "scheme": source, "gptq": layout,
              "group_size": SCHEMES[scheme][0] or 128, "dtype": "float16"}  # GPTQ's scales are float16
             for scheme, (source, layout) in GPTQ.items()]
    # and one saved in float32, whose scales float16 does not hold
    jobs.append({"model_dir": str(tiny_model_dir), "target": str(root / "float32"), "scheme": "W4A16",
                 "group_size": 32, "dtype": "float32"})
    write_checkpoints(jobs)
    return {scheme: root / scheme for scheme in [*SCHEMES, "float32"]}


def library_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The compressed-tensors library's float64 de-quantization of each quantized linear, as its process saved it."""
    return load_file(model_dir.parent / f"{model_dir.name}.reference.safetensors")


def read_checkpoint(model_dir: Path):
    """The checkpoint as the loader reads it, in float32 on the host."""
    return open_checkpoint(ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"))


@pytest.fixture
def run(drive):
    """An engine's greedy tokens for PROMPTS and each token's logprob."""
    def tokens_and_logprobs(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
        outputs = [out.outputs[0] for out in drive(engine, PROMPTS, GREEDY)]
        return [(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]) for o in outputs]
    return tokens_and_logprobs


def engine(model_dir, **knobs) -> LLMEngine:
    return LLMEngine(model=str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory_bytes=POOL, **knobs)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_linear_reads_as_the_librarys_own_dequantization_and_its_blocks_hold_the_same_weights(
        compressed, scheme):
    """Symmetric schemes exactly; those with zero points within float16's rounding of their mins s * (z + 8)."""
    checkpoint = read_checkpoint(compressed[scheme])
    assert isinstance(checkpoint, IntegerCheckpoint)
    reference = library_weights(compressed[scheme])
    assert len(reference) == 14  # 7 linears in each of the 2 layers; the LM head is left out (`ignore`)
    for name, weight in reference.items():
        assert torch.equal(checkpoint.get(name, torch.float64), weight), name
        blocks, qtype = checkpoint.blocks([name])
        assert qtype.name == SCHEMES[scheme][1]
        held = dequantize(blocks, qtype, torch.float64)
        if scheme in ZERO_POINTS:  # within float16's half step at the largest |m| (|m| <= 16 s <= 2 max |w|) ...
            assert (held - weight).abs().max() <= weight.abs().amax() * 2 ** -10, name
            # ... and closer than the library's own de-quantization in the scales' dtype, what transformers runs
            in_bfloat16 = weight.bfloat16().double()
            assert (held - weight).abs().max() <= (in_bfloat16 - weight).abs().max(), name
        else:
            assert torch.equal(held, weight), name
        assert checkpoint.int8_activations([name]) == (scheme == "W8A8")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_engine_on_the_checkpoint_gives_the_tokens_of_one_on_its_dequantized_weights(
        compressed, scheme, tiny_model_dir, tmp_path, run):
    """`quantization` left unset runs the checkpoint as stored, as vLLM does; the reference engine runs a plain
    checkpoint holding the library's de-quantized weights in float32 (and the checkpoint's other tensors)."""
    from safetensors.torch import save_file

    plain = shutil.copytree(tiny_model_dir, tmp_path / "dequantized")
    tensors = {name: tensor.float() for name, tensor in load_file(compressed[scheme] / "model.safetensors").items()
               if tensor.is_floating_point() and not name.endswith((".weight_scale", ".scales"))}
    tensors |= {name: weight.float() for name, weight in library_weights(compressed[scheme]).items()}
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    expected = run(engine(plain))

    quantized = engine(compressed[scheme])
    layer = quantized.decoder.layers[0]
    linears = [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
    assert all(isinstance(linear, QuantizedLinear) and linear.qtype.name == SCHEMES[scheme][1] for linear in linears)
    assert not any(linear.int8 for linear in linears)  # int8 activations are for bfloat16 ones (float32 stays exact)
    got = run(quantized)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected):
        # mins rounded to float16 move this random model's logprobs by up to ~5e-3 (measured)
        assert ours == pytest.approx(theirs, abs=2e-2 if scheme in ZERO_POINTS else 1e-4)


def test_scales_float16_cannot_hold_run_dequantized_and_one_log_line_says_why(compressed, caplog):
    """A checkpoint saved in float32 has float32 scales: its linears run de-quantized, as exactly as stored."""
    model_dir = compressed["float32"]
    with caplog.at_level(logging.INFO, logger="kvloom.engine.model.integer_weights"):
        dense = engine(model_dir)
    said = [r.getMessage() for r in caplog.records if "de-quantized" in r.getMessage()]
    assert len(said) == 1 and "14 linear(s)" in said[0] and "float32 scales" in said[0], said
    assert not isinstance(dense.decoder.layers[0].qkv, QuantizedLinear)
    weights = library_weights(model_dir)
    layer = read_checkpoint(model_dir)
    # s * (q - z) with float32 s, rounded once to float32: the library's float64 product rounded the same
    assert all(torch.equal(layer.get(name, torch.float32), weight.float()) for name, weight in weights.items())


def test_a_tensor_parallel_engine_runs_the_checkpoint_dequantized_with_the_same_tokens(compressed, run):
    expected = run(engine(compressed["W4A16"]))
    split = engine(compressed["W4A16"], tensor_parallel_size=2, distributed_timeout_s=20)
    try:
        assert [tokens for tokens, _ in run(split)] == [tokens for tokens, _ in expected]
    finally:
        split.shutdown()


def test_what_contradicts_the_checkpoint_or_cannot_be_read_is_refused_by_name(compressed, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="quantization.*compressed-tensors checkpoint"):
        engine(compressed["W4A16"], quantization="gguf")
    with pytest.raises(ConfigError, match="quantization.*not a compressed-tensors checkpoint"):
        engine(tiny_model_dir, quantization="compressed-tensors")
    fp8 = shutil.copytree(compressed["W8A16"], tmp_path / "fp8")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["format"] = "float-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "float-quantized"
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="float-quantized"):
        engine(fp8)
    with pytest.raises(ConfigError, match="quantization.*awq checkpoint"):
        engine(compressed["AWQ"], quantization="compressed-tensors")
    with pytest.raises(ModelLoadError, match="'bitsandbytes' is not one kvloom reads"):
        engine(rewritten(compressed["AWQ"], tmp_path / "bitsandbytes", quant_method="bitsandbytes"))


def rewritten(model_dir: Path, target: Path, **changes) -> Path:
    """A copy of the checkpoint whose quantization_config has `changes`."""
    copy = shutil.copytree(model_dir, target)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] |= changes
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_a_module_takes_the_scheme_of_the_group_naming_it_most_closely_and_one_named_by_none_is_refused(
        compressed, tmp_path):
    """As the library ranks targets: the name itself, then a regex, then the class `Linear`, whatever the groups'
    order (a first match would read the 8-bit weights below as 4-bit ones)."""
    [eight_bit] = json.loads((compressed["W8A16"] / "config.json").read_text())["quantization_config"][
        "config_groups"].values()
    four_bit = {**eight_bit, "weights": {**eight_bit["weights"], "num_bits": 4, "strategy": "group", "group_size": 32}}
    model_dir = rewritten(compressed["W8A16"], tmp_path / "ranked", config_groups={
        "first": {**four_bit, "targets": ["Linear"]}, "second": {**eight_bit, "targets": ["re:.*_proj$"]}})
    checkpoint = read_checkpoint(model_dir)
    for name, weight in library_weights(compressed["W8A16"]).items():
        assert torch.equal(checkpoint.get(name, torch.float64), weight), name
    narrow = rewritten(compressed["W8A16"], tmp_path / "narrow",
                       config_groups={"only": {**eight_bit, "targets": ["re:.*q_proj$"]}})
    with pytest.raises(ModelLoadError, match="down_proj is stored quantized but no config group targets it"):
        engine(narrow)


def test_int8_activations_are_those_of_the_linears_whose_group_quantizes_its_inputs(compressed, tmp_path):
    """W8A8 for the MLP, W8A16 for attention: only the MLP's linears take their (bfloat16) activations in int8, where
    the CPU's kernel has VNNI."""
    [w8a8] = json.loads((compressed["W8A8"] / "config.json").read_text())["quantization_config"][
        "config_groups"].values()
    w8a16 = {key: value for key, value in w8a8.items() if key != "input_activations"}
    model_dir = rewritten(compressed["W8A8"], tmp_path / "mixed", config_groups={
        "attention": {**w8a16, "targets": ["re:.*self_attn.*"]}, "mlp": {**w8a8, "targets": ["re:.*mlp.*"]}})
    layer = LLMEngine(model=str(model_dir), dtype="bfloat16", max_model_len=128,
                      kv_cache_memory_bytes=POOL).decoder.layers[1]
    assert [linear.int8 for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] == [
        False, False, int8_dots(), int8_dots()]


def ordered(model_dir: Path, actorder) -> dict:
    """The checkpoint's one config group with activation order `actorder`."""
    [group] = json.loads((model_dir / "config.json").read_text())["quantization_config"]["config_groups"].values()
    return {"group_0": {**group, "weights": {**group["weights"], "actorder": actorder}}}


def test_activation_order_weight_reads_as_consecutive_groups_and_group_order_through_weight_g_idx(
        compressed, tmp_path, caplog):
    """Order `weight` (alias `static`: the library's only one now) changed only the calibration; the older `group`
    order stored each input's group in weight_g_idx, which the library de-quantized by (scale[:, g_idx])."""
    for actorder in ("weight", "static"):
        checkpoint = read_checkpoint(rewritten(compressed["W4A16"], tmp_path / actorder,
                                               config_groups=ordered(compressed["W4A16"], actorder)))
        for name, weight in library_weights(compressed["W4A16"]).items():
            assert torch.equal(checkpoint.get(name, torch.float64), weight), name
            assert checkpoint.blocks([name]) is not None
    grouped = rewritten(compressed["W4A16"], tmp_path / "group", config_groups=ordered(compressed["W4A16"], "group"))
    check_mirrored_groups_run_dequantized(grouped, library_weights(compressed["W4A16"]), tmp_path / "group-mapped",
                                          "weight_g_idx", caplog)


def test_groups_ordered_by_activations_without_their_map_rotations_or_weights_not_yet_compressed_are_refused(
        compressed, tmp_path):
    for name, changes in {"actorder": {"config_groups": ordered(compressed["W4A16"], "group")},
                          "frozen": {"quantization_status": "frozen"},
                          "rotated": {"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}}.items():
        with pytest.raises(ModelLoadError, match="without rotations whose groups are consecutive or mapped"):
            engine(rewritten(compressed["W4A16"], tmp_path / name, **changes))


def gptq_linear(directory: Path, qweight: list[list[int]], qzeros: list[list[int]], scales: list[float] | None = None,
                g_idx: list[int] | None = None) -> Path:
    """One linear from its words as unsigned 32-bit values: qweight [K * bits / 32][N], qzeros [G][N * bits / 32],
    a scale a group (1 where not given) for every output."""
    from safetensors.torch import save_file

    from kvloom.engine.model.gptq import int32_bits

    directory.mkdir()
    outputs = len(qweight[0])
    tensors = {"m.qweight": int32_bits(torch.tensor(qweight)), "m.qzeros": int32_bits(torch.tensor(qzeros)),
               "m.scales": torch.tensor(scales or [1.0] * len(qzeros), dtype=torch.float16)[:, None].repeat(1, outputs)}
    if g_idx is not None:
        tensors["m.g_idx"] = torch.tensor(g_idx, dtype=torch.int32)
    save_file(tensors, directory / "model.safetensors")
    return directory


def read_gptq(model_dir: Path, **config) -> IntegerCheckpoint:
    from kvloom.engine.model.checkpoint import Checkpoint
    from kvloom.engine.model.gptq import open_gptq

    return open_gptq(Checkpoint.open(model_dir, torch.float32, torch.device("cpu")), config)


def words(values: list[int], bits: int) -> list[int]:
    """Values packed into 32-bit words, value i at bit (i % (32 / bits)) * bits of word i // (32 / bits)."""
    per_word = 32 // bits
    return [sum(v << (bits * i) for i, v in enumerate(values[w:w + per_word])) for w in range(0, len(values), per_word)]


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_packs_inputs_down_a_column_and_its_format_gptq_stores_zero_points_less_one_borrows_included(
        tmp_path, bits):
    """A known answer, pinned to GPTQModel's de-quantization (gptqmodel/nn_modules/qlinear: weight i of qweight[r, n]
    is input r * 32 / bits + i; zero point i of qzeros[g, c] is output c * 32 / bits + i) and its v1 -> v2
    conversion (each zero-point word plus 0x11111111, 8-bit 0x01010101): stored less one, a zero point of 0 borrows
    from the next. Output n stores input k as k + 3n (mod 2^bits), zero point n * (2^bits / 8)."""
    top, step = 1 << bits, (1 << bits) // 8
    stored = [[(k + 3 * n) % top for k in range(8)] for n in range(8)]
    columns = [words(row, bits) for row in stored]  # output n's column of qweight
    qweight = [list(row) for row in zip(*columns)]
    zero_words = words([n * step for n in range(8)], bits)
    offset = {4: 0x11111111, 8: 0x01010101}[bits]
    for layout, config in {"gptq": {"checkpoint_format": "gptq"}, "gptq_v2": {"format": "gptq_v2"}}.items():
        qzeros = [[(w - offset) % (1 << 32) if layout == "gptq" else w for w in zero_words]]
        checkpoint = read_gptq(gptq_linear(tmp_path / f"{layout}-{bits}", qweight, qzeros), bits=bits,
                               group_size=-1, sym=False, **config)
        expected = torch.tensor(stored, dtype=torch.float32) - step * torch.arange(8.)[:, None]
        assert torch.equal(checkpoint.get("m.weight"), expected), layout


def test_gptq_inputs_grouped_by_activation_order_read_through_g_idx_and_run_dequantized_said_once(
        compressed, tmp_path, caplog):
    """GPTQModel's w = scales[g_idx] * (weight - zeros[g_idx]) (desc_act): input k in group g_idx[k], here the
    odd inputs in group 0 (scale 1, zero points 8) and the even ones in group 1 (scale 2, zero points 0)."""
    checkpoint = read_gptq(gptq_linear(tmp_path / "known", [[0x76543210] * 8], [[0x88888888], [0]], [1.0, 2.0],
                                       g_idx=[1, 0, 1, 0, 1, 0, 1, 0]), bits=4, group_size=4, desc_act=True,
                           sym=False, checkpoint_format="gptq_v2")
    inputs = torch.arange(8.)
    assert torch.equal(checkpoint.get("m.weight"), torch.where(inputs % 2 == 1, inputs - 8, 2 * inputs).expand(8, 8))
    assert checkpoint.blocks(["m.weight"]) is None

    check_mirrored_groups_run_dequantized(compressed["GPTQ"], library_weights(compressed["GPTQ"]),
                                          tmp_path / "act-order", "g_idx", caplog)


def check_mirrored_groups_run_dequantized(model_dir: Path, reference: dict[str, torch.Tensor], target: Path,
                                          g_idx: str, caplog) -> None:
    """A copy of a symmetric checkpoint of consecutive groups (`reference`: the library's weights), each linear's
    `<linear>.<g_idx>` (written where missing) giving the inputs of group i to group G-1-i: each weight then takes
    its group's mirror's scale (w = s * q, so q is the reference over its own scale), and every linear runs
    de-quantized, said in one line."""
    from safetensors.torch import save_file

    copy = shutil.copytree(model_dir, target)
    tensors = load_file(copy / "model.safetensors")
    expected = {}
    for name, weight in reference.items():
        prefix = name.removesuffix(".weight")
        scale = tensors[f"{prefix}.weight_scale"] if f"{prefix}.weight_scale" in tensors else tensors[
            f"{prefix}.scales"].T  # [N, G]: compressed-tensors', GPTQ's transposed
        inputs, groups = weight.shape[1], scale.shape[1]
        tensors[f"{prefix}.{g_idx}"] = (groups - 1 - torch.arange(inputs) // (inputs // groups)).to(torch.int32)
        consecutive = scale.double().repeat_interleave(inputs // groups, 1)
        expected[name] = weight / consecutive * consecutive.flip(1)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    checkpoint = read_checkpoint(copy)
    assert all(torch.equal(checkpoint.get(name, torch.float64), weight) for name, weight in expected.items())
    with caplog.at_level(logging.INFO, logger="kvloom.engine.model.integer_weights"):
        dense = engine(copy)
    said = [r.getMessage() for r in caplog.records if "de-quantized" in r.getMessage()]
    assert len(said) == 1 and "14 linear(s)" in said[0] and "activation order" in said[0], said
    assert not isinstance(dense.decoder.layers[0].qkv, QuantizedLinear)


def test_gptq_that_would_read_as_other_weights_is_refused_by_name(compressed, tmp_path):
    refusals = {"marlin": ({"checkpoint_format": "marlin"}, "kvloom reads 4- and 8-bit gptq and gptq_v2 packed in"),
                "3-bit": ({"bits": 3}, "kvloom reads 4- and 8-bit"), "int16": ({"pack_dtype": "int16"}, "in int32"),
                "disagree": ({"format": "gptq_v2"}, "format and checkpoint_format disagree"),
                "dynamic": ({"dynamic": {"+:.*down_proj.*": {"bits": 8}}}, "per-module overrides"),
                "rotation": ({"rotation": "hadamard"}, "rotation 'hadamard'"),
                "activation": ({"activation": {"mlp": "fp8"}}, "weight-only GPTQ")}
    for name, (changes, message) in refusals.items():
        with pytest.raises(ModelLoadError, match=message):
            engine(rewritten(compressed["GPTQ"], tmp_path / name, **changes))
    with pytest.raises(ModelLoadError, match="zero points are not 8"):
        engine(rewritten(compressed["GPTQ_ASYM"], tmp_path / "not-symmetric", sym=True))
    # overrides that only leave modules unquantized change nothing kvloom reads: those have plain weights
    engine(rewritten(compressed["GPTQ"], tmp_path / "skips", dynamic={"-:.*lm_head.*": {}}))
