"""kvloom's fused decoder (`engine/model/decoder.py`) computes what the stock transformers forward does.

The fused C++ rotary and residual-add + RMSNorm ops and the greedy row argmax equal their torch definitions; a
linear takes the layout of the CPU's fastest unit (oneDNN, packed or shared with a tied embedding; kvloom's blocked
kernel on AVX-512 without AMX, within float32's or bfloat16's rounding of a float64 product, the same bits on any
thread count) and equals F.linear at every row count a step can have; RoPE tables equal transformers' for
every variant the decoder runs; architectures the decoder covers (Llama, Qwen2 with its QKV biases) run fused and match
`generate` token for token, and load without transformers' model classes; one it does not cover (Qwen3's per-head q/k
norms) runs the stock forward under `auto` and is refused, with the reason, under `model_impl="kvloom"`.
"""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from kvloom.engine.model import decoder
from kvloom.engine.model.attention import ForwardContext
from kvloom.engine.model.decoder import FusedDecoder
from kvloom.engine.errors import ConfigError, ModelLoadError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.rotary import RotaryEmbedding, unsupported_rope
from kvloom.engine.model.stock_decoder import StockDecoder
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels import fused_ops, packed_linear
from kvloom.kernels.host_isa import HostISA
from kvloom.kernels.metadata import AttentionMetadata
from kvloom.kernels.packed_linear import HostKernels, Layout, PackedLinear, choose_layout, host_layout, to_blocked

PROMPTS = [[5, 9, 13, 200], list(range(3, 80)), [7] * 33]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
POOL = 1 << 24  # KV bytes: room for these prompts (zeroing the default 2 GiB costs every engine ~0.2 s)


# a bfloat16 result differs from its float32 definition by at most one rounding (2^-8 relative)
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 8, 128)])
def test_cpp_rotary_equals_its_torch_definition(monkeypatch, heads, kv_heads, head_dim, dtype):
    assert fused_ops.fused_extension() is not None, "the C++ fused ops failed to build"
    torch.manual_seed(0)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    native = qkv.clone()
    fused_ops.rotary_embedding_(native, cos, sin, heads + kv_heads, head_dim)
    monkeypatch.setattr(fused_ops, "fused_extension", lambda: None)
    defined = qkv.clone()
    fused_ops.rotary_embedding_(defined, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(native.float(), defined.float(), **TOLERANCE[dtype])
    assert torch.equal(native[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("with_delta", [False, True])
def test_cpp_add_rms_norm_equals_its_torch_definition(monkeypatch, rows, with_delta, dtype):
    """Under a bfloat16 model the residual and the weight stay float32; delta comes from a bfloat16 GEMM and
    the output feeds one."""
    assert fused_ops.fused_extension() is not None, "the C++ fused ops failed to build"
    torch.manual_seed(0)
    residual, weight = torch.randn(rows, 576) * 3, torch.rand(576) + 0.5
    delta = torch.randn(rows, 576).to(dtype) if with_delta else None
    native_residual = residual.clone()
    native = fused_ops.add_rms_norm_(native_residual, delta, weight, 1e-5, dtype)
    monkeypatch.setattr(fused_ops, "fused_extension", lambda: None)
    defined_residual = residual.clone()
    defined = fused_ops.add_rms_norm_(defined_residual, delta, weight, 1e-5, dtype)
    assert native.dtype == defined.dtype == dtype and native_residual.dtype == torch.float32
    torch.testing.assert_close(native_residual, defined_residual, atol=0, rtol=0)
    torch.testing.assert_close(native.float(), defined.float(), **TOLERANCE[dtype])
    if with_delta:
        torch.testing.assert_close(native_residual, residual + delta.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 600])
def test_cpp_silu_and_mul_equals_its_torch_definition(monkeypatch, rows, dtype):
    assert fused_ops.fused_extension() is not None, "the C++ fused ops failed to build"
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * 96) * 6).to(dtype)  # gates far into both tails of the sigmoid
    native = fused_ops.silu_and_mul(gate_up)
    monkeypatch.setattr(fused_ops, "fused_extension", lambda: None)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert native.dtype == dtype and native.shape == (rows, 96)
    torch.testing.assert_close(native.float(), torch.nn.functional.silu(gate) * up, **TOLERANCE[dtype])
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up).float(), native.float(), atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 300, 49152])
def test_cpp_argmax_picks_each_rows_first_maximum_as_torch_max_does(dtype, vocab):
    """Ties (the first wins), a maximum in the last partial chunk, rows of -inf, rows read with a stride."""
    assert fused_ops.fused_extension() is not None, "the C++ fused ops failed to build"
    torch.manual_seed(0)
    wide = torch.randn(9, vocab + 5).to(dtype)
    logits = wide[:, :vocab]  # each row strided past the next one's start
    logits[1, vocab // 3] = logits[1, vocab - 1] = 100  # a tie
    logits[2, vocab - 1] = 100  # in the last chunk
    logits[3] = -float("inf")
    native = fused_ops.argmax_rows(logits)
    assert native.dtype == torch.int64 and torch.equal(native, logits.max(dim=-1).indices)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("make", [PackedLinear.pack, PackedLinear.share])
def test_float32_linear_equals_f_linear(rows, with_bias, make):
    """Packed in this host's layout, or oneDNN reading the weight as it is (shared)."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 40), torch.randn(rows, 40)
    bias = torch.randn(96) if with_bias else None
    linear = make(weight, bias)
    shared = Layout.SHARED if torch.backends.mkldnn.is_available() else Layout.DENSE
    assert linear.layout is (host_layout(weight) if make == PackedLinear.pack else shared)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_bfloat16_linear_matches_a_float32_reference(rows):
    """Within bfloat16's rounding of the float32 product of the same (rounded) operands, in this host's layout."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 256).bfloat16(), torch.randn(rows, 256).bfloat16()
    linear = PackedLinear.pack(weight)
    assert linear.layout is host_layout(weight)
    out = linear(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, atol=0.1, rtol=1e-2)


F32, BF16 = torch.float32, torch.bfloat16
ALL_BUILT = HostKernels(onednn=True, blocked=frozenset({F32, BF16}))
NO_BLOCKED_BUILD = HostKernels(onednn=True, blocked=frozenset())
NO_ONEDNN = HostKernels(onednn=False, blocked=frozenset())
AMX, ZEN4, AVX512, AVX2 = ("avx2 avx512f amx_bf16 amx_tile avx512_bf16", "avx2 avx512f avx512_bf16", "avx2 avx512f",
                           "avx2")
# (CPU flags, what the host's builds run, dtype) -> layout: AMX tiles through oneDNN; kvloom's blocked kernel on other
# AVX-512 CPUs where it was built; elsewhere oneDNN, or dense bfloat16 where oneDNN would emulate it
LAYOUTS = [
    (AMX, ALL_BUILT, F32, Layout.ONEDNN), (AMX, ALL_BUILT, BF16, Layout.ONEDNN),
    (ZEN4, ALL_BUILT, F32, Layout.BLOCKED), (ZEN4, ALL_BUILT, BF16, Layout.BLOCKED),
    (AVX512, ALL_BUILT, F32, Layout.BLOCKED), (AVX512, ALL_BUILT, BF16, Layout.BLOCKED),
    (AVX2, ALL_BUILT, F32, Layout.ONEDNN), (AVX2, ALL_BUILT, BF16, Layout.DENSE),
    (ZEN4, NO_BLOCKED_BUILD, BF16, Layout.ONEDNN), (AVX512, NO_BLOCKED_BUILD, BF16, Layout.DENSE),
    (AVX512, NO_BLOCKED_BUILD, F32, Layout.ONEDNN), (AMX, NO_ONEDNN, BF16, Layout.DENSE),
    (AVX2, NO_ONEDNN, F32, Layout.DENSE),
]


@pytest.mark.parametrize("flags,kernels,dtype,expected", LAYOUTS)
def test_weights_take_the_layout_of_the_cpus_fastest_unit(monkeypatch, flags, kernels, dtype, expected):
    """Decided from a faked CPU's flags without running its instructions: the packing step is stubbed to record
    the layout asked for, so every row runs on any host (an AVX2-only one included)."""
    asked: list[Layout] = []
    monkeypatch.setattr(packed_linear, "host_isa", lambda: HostISA("fake", frozenset(flags.split())))
    monkeypatch.setattr(HostKernels, "here", classmethod(lambda cls: kernels))
    monkeypatch.setattr(packed_linear, "lay_out", lambda weight, layout: asked.append(layout) or weight)
    assert PackedLinear.pack(torch.randn(64, 32).to(dtype)).layout is expected
    assert asked == [expected]


def test_a_shared_weight_is_read_by_onednn_in_place_or_runs_dense():
    weight = torch.randn(64, 32)
    isa = HostISA("fake", frozenset(AVX512.split()))
    assert choose_layout(weight, isa, ALL_BUILT, shared=True) is Layout.SHARED
    assert choose_layout(weight.T, isa, ALL_BUILT, shared=True) is Layout.DENSE  # oneDNN needs it contiguous
    assert choose_layout(weight.bfloat16(), isa, ALL_BUILT, shared=True) is Layout.DENSE  # would emulate bfloat16
    assert choose_layout(weight, isa, NO_ONEDNN, shared=True) is Layout.DENSE


def blocked_kernel(dtype: torch.dtype):
    return pytest.param(dtype, id=str(dtype).removeprefix("torch."), marks=pytest.mark.host("blocked-gemm"))


BLOCKED_DTYPES = [blocked_kernel(torch.float32), blocked_kernel(torch.bfloat16)]


@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 48, 49, 300])
@pytest.mark.parametrize("outputs", [32, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_blocked_kernel_matches_a_float64_reference(dtype, rows, outputs, with_bias):
    """Every row block (1-12 rows) and a last block of outputs padded past the weight's rows; the bias added in
    float32 before the one rounding to bfloat16 (within half a bfloat16 step), or float32 throughout."""
    torch.manual_seed(0)
    weight, x = torch.randn(outputs, 258).to(dtype), torch.randn(rows, 258).to(dtype)
    bias = torch.randn(outputs).to(dtype) if with_bias else None
    linear = PackedLinear(to_blocked(weight), None if bias is None else bias.float(), Layout.BLOCKED, outputs)
    out = linear(x)
    assert out.dtype == dtype and out.shape == (rows, outputs)
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    rounding = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=rounding)


@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
def test_the_blocked_kernel_gives_the_same_bits_on_any_thread_count(same_on_any_thread_count, dtype):
    """Work items go to whichever thread asks first, but each output is one thread's sum in one order, on
    torch's OpenMP team or kvloom's item pool."""
    torch.manual_seed(0)
    weight, x = torch.randn(3072, 576).to(dtype), torch.randn(100, 1152).to(dtype)[:, ::2]  # not contiguous
    linear = PackedLinear(to_blocked(weight), None, Layout.BLOCKED, 3072)
    assert same_on_any_thread_count(lambda: linear(x))


def test_a_tied_float32_lm_head_reads_the_embedding_table_itself_where_onednn_runs_it(
        tmp_path, build_tiny_model, greedy_reference, drive):
    """In float32 under oneDNN, no second copy of the table: the head's weight is the very tensor the embedding
    lookup reads. Where kvloom's blocked kernel runs every linear, the head is a blocked copy (every GEMM of a
    step on kvloom's own threads)."""
    model_dir = build_tiny_model(tmp_path, tied=True)
    engine = LLMEngine(dtype="float32", model=str(model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    fused = engine.decoder
    if host_layout(fused.embed) is Layout.BLOCKED:
        assert fused.lm_head.layout is Layout.BLOCKED and fused.runs_on_own_kernels()
    else:
        assert fused.lm_head.weight.data_ptr() == fused.embed.data_ptr() and not fused.lm_head.packed
    outputs = drive(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(model_dir, PROMPTS, 16)


def test_a_bfloat16_model_keeps_its_residual_and_norms_in_float32(tmp_path, build_tiny_model, drive):
    """bfloat16 GEMMs (a tied head packed where a kernel of the CPU's runs bfloat16 fast: 2x the dense one),
    float32 residual stream and norm weights."""
    model_dir = build_tiny_model(tmp_path, tied=True)
    engine = LLMEngine(dtype="bfloat16", model=str(model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    fused = engine.decoder
    assert fused.embed.dtype == torch.bfloat16 and fused.final_norm.dtype == torch.float32
    assert all(layer.input_norm.dtype == layer.post_attention_norm.dtype == torch.float32 for layer in fused.layers)
    assert fused.lm_head.packed == (host_layout(fused.embed) is not Layout.DENSE)
    meta = AttentionMetadata.build([3], [3], [[0]], 4, torch.device("cpu"))
    hidden = fused(torch.tensor([5, 9, 13]), torch.arange(3), ForwardContext(meta, engine.runner.kv_caches,
                                                                             engine.runner.backend))
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert hidden.dtype == torch.bfloat16 and fused.logits(hidden).dtype == torch.bfloat16


def test_the_mlp_in_row_passes_matches_generate(tiny_model_dir, monkeypatch, greedy_reference, drive):
    monkeypatch.setattr(decoder, "MLP_ROWS", 8)  # every prefill spans several passes, the last one partial
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    outputs = drive(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(tiny_model_dir, PROMPTS, 16)


class RowSpy:
    """A linear that records how many rows it was given."""

    def __init__(self, linear) -> None:
        self.linear, self.rows = linear, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.linear(x)


@pytest.mark.parametrize("keep", [[6, 11], []])
def test_the_last_layer_projects_and_runs_its_mlp_for_the_kept_rows_only(tiny_model_dir, keep):
    """A step's hidden states are read at its sample rows only (a prompt chunk's last row at most): the last
    layer still writes every row's K/V, and the kept rows' hidden states are those of the full pass."""
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    fused, runner = engine.decoder, engine.runner
    meta = AttentionMetadata.build([7, 5], [7, 5], [[0, 1], [2, 3]], 4, torch.device("cpu"))
    ids, positions = torch.tensor([5, 9, 13, 200, 7, 7, 7, 3, 4, 5, 6, 8]), torch.tensor([*range(7), *range(5)])

    def run(keep_rows):
        for cache in (tensor for layer in runner.kv_caches for tensor in layer):
            cache.zero_()
        hidden = fused(ids, positions, ForwardContext(meta, runner.kv_caches, runner.backend), keep_rows=keep_rows)
        return hidden, [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    full, full_caches = run(None)
    last = fused.layers[-1]
    last.o_proj, last.gate_up = RowSpy(last.o_proj), RowSpy(last.gate_up)
    kept, kept_caches = run(torch.tensor(keep, dtype=torch.int64))
    torch.testing.assert_close(kept, full[keep], atol=1e-6, rtol=1e-6)
    assert all(torch.equal(a, b) for pair, other in zip(full_caches, kept_caches) for a, b in zip(pair, other))
    assert last.o_proj.rows == ([len(keep)] if keep else []) and last.gate_up.rows == last.o_proj.rows


def test_an_untied_lm_head_is_packed(tiny_model_dir):
    fused = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL).decoder
    assert fused.lm_head.packed == torch.backends.mkldnn.is_available()


def test_a_fused_engine_never_imports_the_transformers_model_classes(tiny_model_dir):
    """They pull torch._dynamo, sympy and torch.distributed in: ~180 MB of every replica's memory."""
    script = (
        "import sys; from kvloom.engine.llm_engine import LLMEngine; "
        f"engine = LLMEngine(model={str(tiny_model_dir)!r}, block_size=4, kv_cache_memory_bytes={POOL}); "
        "print(type(engine.decoder).__name__, [m for m in ('torch._dynamo', 'sympy', 'transformers.modeling_utils') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "FusedDecoder" and out.strip().endswith("[]"), out


def test_a_sharded_checkpoint_runs_fused_and_matches_generate(tmp_path, tiny_model_dir, greedy_reference, drive):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    engine = LLMEngine(dtype="float32", model=str(sharded), block_size=4, kv_cache_memory_bytes=POOL,
                       model_impl="kvloom")
    outputs = drive(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(tiny_model_dir, PROMPTS, 16)


def test_a_checkpoint_missing_a_weight_names_it(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    damaged = shutil.copytree(tiny_model_dir, tmp_path / "damaged")
    weights = load_file(damaged / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError,
                       match=re.escape(f"the checkpoint in {damaged} has no tensor model.layers.1.mlp.down_proj.weight")):
        LLMEngine(dtype="float32", model=str(damaged), block_size=4)


ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def with_rope(tmp_path, model_dir, rope: dict | None):
    raw = json.loads((model_dir / "config.json").read_text())
    raw["rope_parameters"] = {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rope_tables_equal_the_stock_models(tmp_path, tiny_model_dir, variant):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = with_rope(tmp_path, tiny_model_dir, ROPE_VARIANTS[variant])
    assert unsupported_rope(config) is None
    positions = torch.tensor([0, 1, 5, 255, 256, 1000])
    cos, sin = RotaryEmbedding.of(config, torch.device("cpu")).cos_sin(positions)
    stock_cos, stock_sin = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))(cos, positions[None])
    torch.testing.assert_close((cos, sin), (stock_cos[0], stock_sin[0]), atol=0, rtol=0)


def test_length_dependent_rope_keeps_the_stock_forward(tmp_path, tiny_model_dir):
    config = with_rope(tmp_path, tiny_model_dir, {"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in unsupported_rope(config)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, build_tiny_model):
    return {kind: build_tiny_model(tmp_path_factory.mktemp(kind), model_type=kind) for kind in ("qwen2", "qwen3")}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_each_family_matches_generate_under_auto(family_dirs, model_type, greedy_reference, drive):
    engine = LLMEngine(dtype="float32", model=str(family_dirs[model_type]), block_size=4, kv_cache_memory_bytes=POOL)
    assert type(engine.decoder) is (FusedDecoder if model_type == "qwen2" else StockDecoder)
    outputs = drive(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(family_dirs[model_type], PROMPTS, 16)


def test_fused_decoder_refuses_an_architecture_it_does_not_cover(family_dirs):
    with pytest.raises(ConfigError, match="model_impl.*does not cover this model \\(qwen3 layers\\)"):
        LLMEngine(dtype="float32", model=str(family_dirs["qwen3"]), model_impl="kvloom")
