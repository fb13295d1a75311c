"""Multi-LoRA in one engine: rows of several PEFT adapters and of the base model in one step, each computing exactly
what transformers + peft computes with that adapter merged into a copy of the base; KV never shared across adapters;
adapter slots and host memory bounded without losing a request; bad adapters refused by name."""

import itertools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from kvloom.benchmarks.random_weights import write_random_adapter
from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import AdapterNotFoundError, ConfigError, InvalidRequestError
from kvloom.engine.llm import LLM
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.lora.lora_step import LoRAStep
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
POOL = 1 << 24  # KV bytes: room for these prompts (zeroing the default 2 GiB costs every engine ~0.2 s)
# four adapters unlike each other: ranks, and which of the seven projections they patch
SHAPES = {
    "qv-r4": (4, ("q_proj", "v_proj")),
    "all-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "mlp-r16": (16, ("up_proj", "down_proj")),
    "o-r2": (2, ("o_proj",)),
}


def make_adapters(model_dir, root, shapes: dict = SHAPES) -> dict[str, str]:
    config = ModelConfig.from_dir(model_dir)
    return {name: str(write_random_adapter(root / name, config, rank, seed=i, targets=targets))
            for i, (name, (rank, targets)) in enumerate(shapes.items())}


def peft_greedy(model_dir, adapters: dict[str | None, str | None], prompts: list[list[int]],
                max_new: int) -> dict[str | None, list[list[int]]]:
    """transformers generate, per adapter, on a copy of the base with the adapter merged by peft (None: the base)."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    eos = base.generation_config.eos_token_id
    results = {}
    for name, adapter_dir in adapters.items():
        model = (PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload() if adapter_dir
                 else base)
        with torch.inference_mode():
            results[name] = [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                                            max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                            pad_token_id=eos)[0, len(ids):].tolist() for ids in prompts]
    return results


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(length)] for length in (5, 11, 23, 40)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters, prompts, every_core) -> dict[str | None, list[list[int]]]:
    """Each prompt's greedy tokens under the base and under each adapter."""
    with every_core():
        return peft_greedy(tiny_model_dir, {None: None, **adapters}, prompts, MAX_NEW)


def mixed_batch(names: list[str | None], prompts: list[list[int]]) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under every name, interleaved so that neighbouring rows have different adapters."""
    pairs = [(prompt, name) for prompt in prompts for name in names]
    return [p for p, _ in pairs], [n for _, n in pairs]


def test_a_mixed_batch_of_four_adapters_and_the_base_equals_peft_merged_on_a_tiny_model(
        tiny_model_dir, adapters, prompts, expected):
    names = [None, *adapters]
    assert all(expected[name] != expected[None] for name in adapters)  # each adapter changes what is generated
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=POOL,
              lora={"adapters": adapters, "max_loras": 4})
    batch, batch_names = mixed_batch(names, prompts)
    got = tokens(llm.generate(batch, GREEDY, lora=batch_names))
    assert got == [expected[name][prompts.index(prompt)] for prompt, name in zip(batch, batch_names)]


@pytest.mark.slow
def test_a_mixed_batch_of_four_adapters_and_the_base_equals_peft_merged_on_smollm2(smollm2_dir, smollm2_prompts,
                                                                                    tmp_path, every_core):
    """SmolLM2's 30 layers with random adapters made here, float32."""
    # an o_proj-only adapter of rank 2 changes none of SmolLM2's first 8 tokens of these prompts: rank 8 does
    adapters = make_adapters(smollm2_dir, tmp_path, {**{k: v for k, v in SHAPES.items() if k != "o-r2"},
                                                     "o-r8": (8, ("o_proj",))})
    prompts = smollm2_prompts[-2:]  # two raw prompts (code, numbers), on which every one of these adapters differs
    with every_core():
        expected = peft_greedy(smollm2_dir, {None: None, **adapters}, prompts, 8)
    assert all(expected[name] != expected[None] for name in adapters)
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512,
              lora={"adapters": adapters, "max_loras": 4})
    batch, batch_names = mixed_batch([None, *adapters], prompts)
    got = tokens(llm.generate(batch, SamplingParams(max_tokens=8, temperature=0), lora=batch_names))
    assert got == [expected[name][prompts.index(prompt)] for prompt, name in zip(batch, batch_names)]


def test_a_chunked_prefill_step_mixing_prompts_and_decodes_of_several_adapters_keeps_each_exact(
        tiny_model_dir, adapters, prompts, expected, drive):
    """Small token budget: prompt chunks of one adapter run beside decode rows of others, and the MLP's row
    windows and the last layer's kept rows cut across adapters' segments."""
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       max_num_batched_tokens=24, max_num_seqs=24, lora={"adapters": adapters, "max_loras": 4})
    names = [None, *adapters]
    outputs = {}
    for step in range(10_000):
        if step < len(names) * len(prompts):
            name, prompt = names[step % len(names)], prompts[step // len(names)]
            engine.add_request(f"{name}/{prompts.index(prompt)}", prompt, GREEDY, lora=name)
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        if not engine.has_unfinished() and step >= len(names) * len(prompts):
            break
    assert outputs == {f"{n}/{i}": expected[n][i] for n in names for i in range(len(prompts))}


def test_the_same_prompt_under_two_adapters_shares_no_kv_block(tiny_model_dir, adapters, prompts):
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       lora={"adapters": adapters, "max_loras": 2})
    prompt, ids = prompts[-1], itertools.count()  # 40 tokens: ten full blocks

    def cached_tokens(name: str | None) -> int:
        request = engine.add_request(f"r{next(ids)}", prompt, GREEDY, lora=name)
        while engine.has_unfinished():
            engine.step()
        return request.num_cached_prompt_tokens

    assert cached_tokens("qv-r4") == 0
    assert cached_tokens("all-r8") == 0  # the same tokens, another adapter: its own KV
    assert cached_tokens(None) == 0  # nor the base model's
    assert cached_tokens("qv-r4") == 36  # its own blocks are found again (all but the last token's block)


def test_a_requests_adapter_goes_with_its_kv_to_a_decode_engine_and_with_its_tokens_to_a_continuing_one(
        tiny_model_dir, adapters, prompts, expected):
    """Disaggregation and mid-stream failover build the request on the other engine from the router's message,
    which names the adapter: the decode engine computes on under it from the prefill's KV, and an engine taking
    over a cut stream recomputes the prompt and the streamed tokens under it (not under the base model)."""
    from kvloom.engine.kv_handoff import export_kv, import_kv

    def engine() -> LLMEngine:
        return LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                         lora={"adapters": adapters})

    def finish(engine: LLMEngine) -> list[int]:
        done = []
        while engine.has_unfinished():
            done += [o for o in engine.step() if o.finished]
        return done[0].outputs[0].token_ids

    prefill, decode, successor = engine(), engine(), engine()
    for name in ("all-r8", "mlp-r16"):
        prompt, want = prompts[2], expected[name][2]
        assert want != expected[None][2]  # under the base model this prompt goes another way
        request = prefill.make_request(f"{name}-p", prompt, GREEDY.model_copy(update={"max_tokens": 1}), lora=name)
        request.park_kv = True
        prefill.add_prepared(request)
        first = finish(prefill)[0]
        _, payload = export_kv(prefill, f"{name}-p")
        assert import_kv(decode, decode.make_request(f"{name}-d", prompt, GREEDY, lora=name), first, payload)
        prefill.release_parked(f"{name}-p")
        assert [first, *finish(decode)[1:]] == want

        streamed = want[:5]
        successor.add_continued(successor.make_request(f"{name}-c", prompt, GREEDY, lora=name), streamed,
                                len(successor.tokenizer.decode(streamed)))
        assert finish(successor) == want
    assert all(e.stats().num_free_blocks == e.num_blocks for e in (prefill, decode, successor))


def test_adapter_slots_bound_the_running_batch_and_evicted_adapters_come_back_without_losing_a_request(
        tiny_model_dir, adapters, prompts, expected):
    """max_loras 1: never two adapters in one step, yet no request waits forever; max_cpu_loras 1: every switch
    reads the adapter from its directory again."""
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       lora={"adapters": adapters, "max_loras": 1, "max_cpu_loras": 1})
    names = [None, *adapters]
    batch, batch_names = mixed_batch(names, prompts)
    loads_at_start = engine.adapters.num_loads
    for i, (prompt, name) in enumerate(zip(batch, batch_names)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=name)
    outputs, most_adapters = {}, 0
    while engine.has_unfinished():
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        most_adapters = max(most_adapters, len({r.lora.name for r in engine.scheduler.running if r.lora}))
    assert most_adapters == 1
    assert outputs == {f"r{i}": expected[name][prompts.index(prompt)]
                       for i, (prompt, name) in enumerate(zip(batch, batch_names))}
    assert engine.adapters.num_loads - loads_at_start >= len(adapters)  # evicted adapters were read again
    assert len(engine.adapters.host) == 1


@pytest.mark.parametrize("tenure_s", [0.0, 3600.0])
def test_a_steady_stream_for_one_adapter_gives_up_its_slot_to_a_waiting_one_after_its_tenure(
        tiny_model_dir, adapters, prompts, tenure_s):
    """max_loras 1 and a new request for one adapter every step, so its slot never empties by itself: past its
    tenure it takes no request from behind the one waiting for another adapter, drains, and the waiting one gets the
    slot (within its tenure, an hour here, it would keep it for the whole test). Every request is served."""
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       lora={"adapters": adapters, "max_loras": 1, "slot_tenure_s": tenure_s})
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    finished, other_started = set(), None
    for step in range(40):
        engine.add_request(f"qv-{step}", prompts[step % len(prompts)], params, lora="qv-r4")
        if step == 3:
            other = engine.add_request("other", prompts[0], params, lora="mlp-r16")
        finished |= {o.request_id for o in engine.step() if o.finished}
        if other_started is None and step >= 3 and other.num_output_tokens:
            other_started = step
    if tenure_s > 40:
        assert other_started is None  # the stream kept the slot, as it may within its tenure
        return
    assert other_started is not None and other_started < 15
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"qv-{step}" for step in range(40)} | {"other"}


def test_ngram_speculation_under_an_adapter_keeps_its_greedy_tokens(tiny_model_dir, adapters, prompts, expected):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=POOL, speculative_config=ngram,
              lora={"adapters": adapters})
    names = [None, *adapters]
    batch, batch_names = mixed_batch(names, prompts)
    got = tokens(llm.generate(batch, GREEDY, lora=batch_names))
    assert got == [expected[name][prompts.index(prompt)] for prompt, name in zip(batch, batch_names)]
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0


def test_adapters_come_and_go_at_run_time_and_a_request_holding_an_unloaded_one_still_finishes(
        tiny_model_dir, adapters, prompts, expected, tmp_path):
    shutil.copytree(adapters["mlp-r16"], tmp_path / "dynamic" / "from-dir")
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       lora={"dynamic_loading_path": str(tmp_path / "dynamic")})
    assert engine.adapters.names() == ["from-dir"]
    engine.adapters.load("late", adapters["o-r2"])
    assert engine.adapters.names() == ["from-dir", "late"]
    late = engine.add_request("late", prompts[0], GREEDY, lora="late")
    on_demand = engine.add_request("dir", prompts[1], GREEDY, lora="from-dir")
    engine.step()
    engine.adapters.unload("late")
    with pytest.raises(AdapterNotFoundError, match="'late'"):
        engine.add_request("refused", prompts[0], GREEDY, lora="late")
    while engine.has_unfinished():
        engine.step()
    assert late.output_token_ids == expected["o-r2"][0]
    assert on_demand.output_token_ids == expected["mlp-r16"][1]


def test_bad_adapters_are_refused_by_name_and_field(tiny_model_dir, adapters, tmp_path, build_tiny_model):
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       lora={"max_lora_rank": 8, "dynamic_loading_path": str(tmp_path)})
    with pytest.raises(AdapterNotFoundError, match="'nobody'") as unknown:
        engine.add_request("a", [5, 6, 7], GREEDY, lora="nobody")
    assert unknown.value.field == "model"
    with pytest.raises(InvalidRequestError, match="rank 16; max_lora_rank is 8") as too_wide:
        engine.adapters.load("wide", adapters["mlp-r16"])
    assert too_wide.value.field == "lora_path"
    other = ModelConfig.from_dir(build_tiny_model(tmp_path / "wider", context=512))
    wrong = write_random_adapter(tmp_path / "wrong", ModelConfig(**{**other.__dict__, "hidden_size": 96}), 4)
    with pytest.raises(InvalidRequestError, match="do not fit the base model's"):
        engine.adapters.load("wrong", wrong)
    dora = shutil.copytree(adapters["qv-r4"], tmp_path / "dora")
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(InvalidRequestError, match="DoRA"):
        engine.add_request("b", [5, 6, 7], GREEDY, lora="dora")  # found under the dynamic path, refused on read
    with pytest.raises(AdapterNotFoundError):
        LLMEngine(dtype="float32", model=str(tiny_model_dir), kv_cache_memory_bytes=POOL).add_request(
            "c", [5], GREEDY, lora="qv-r4")
    assert engine.stats().num_running == 0 and not engine.has_unfinished()  # nothing was queued
    with pytest.raises(ConfigError, match="lora.adapters.wide"):
        LLMEngine(dtype="float32", model=str(tiny_model_dir), kv_cache_memory_bytes=POOL,
                  lora={"adapters": {"wide": adapters["mlp-r16"]}, "max_lora_rank": 8})


def test_an_adapter_replaced_between_its_check_and_its_read_is_a_400_not_a_crash(tiny_model_dir, adapters,
                                                                                 monkeypatch):
    """An adapter is checked from its header, then read: a file swapped in between (here: another adapter's
    tensors read in its place) is refused by name, and the engine goes on serving."""
    import kvloom.engine.lora.adapter as adapter_module

    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL,
                       lora={"max_lora_rank": 16})
    read = adapter_module.load_file
    monkeypatch.setattr(adapter_module, "load_file", lambda path: read(Path(adapters["mlp-r16"]) / path.name))
    with pytest.raises(InvalidRequestError, match="changed while it was read") as swapped:
        engine.adapters.load("swapped", adapters["qv-r4"])
    assert swapped.value.field == "lora_path"
    monkeypatch.setattr(adapter_module, "load_file", read)
    engine.adapters.load("swapped", adapters["qv-r4"])
    request = engine.add_request("after", [5, 6, 7], GREEDY, lora="swapped")
    while engine.has_unfinished():
        engine.step()
    assert request.is_finished and len(request.output_token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("knobs, refusal", [
    ({"tensor_parallel_size": 2}, "lora with tensor_parallel_size"),
    ({"model_impl": "transformers"}, "lora with model_impl"),
    ({"speculative_config": {"method": "layer_skip", "num_speculative_tokens": 2, "draft_layers": 1}},
     "lora with speculative_config"),
    ({"lora": {"max_loras": 8, "max_cpu_loras": 4}}, "max_cpu_loras"),
    ({"lora": {"adapters": {"base:x": "/nowhere"}}}, "adapter name 'base:x'"),
])
def test_settings_adapters_cannot_work_with_are_refused_at_the_edge(knobs, refusal):
    with pytest.raises(ValueError, match=refusal):
        EngineConfig(**{"lora": {}, **knobs})


def test_a_step_segments_rows_by_adapter_and_keeps_the_lm_heads_rows():
    a, b = object(), object()
    step = LoRAStep.of_rows([(3, None), (2, a), (1, a), (4, b), (1, None)], sample_rows=[2, 4, 5, 9, 10])
    assert [(s.start, s.end, s.adapter) for s in step.segments] == [(3, 6, a), (6, 10, b)]
    assert [(s.start, s.end, s.adapter) for s in step.kept] == [(1, 3, a), (3, 4, b)]
    assert not LoRAStep.of_rows([(3, None)], [2])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_the_cpu_kernel_adds_each_segments_delta_from_bs_nonzero_blocks_only(dtype, tolerance):
    """Odd widths (SIMD tails), ranks under the kernel's unroll, segments of 1 to 11 rows (a work item takes up to
    8), a segment split between two calls; B's zero blocks hold NaN, so reading them would show."""
    from kvloom.kernels.cpu_lora import lora_add_, lora_extension, pack_expand, weights_table

    if lora_extension() is None:
        pytest.skip("the C++ kernel cannot be built here")
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 37, generator=generator).to(dtype), torch.randn(24, 50, generator=generator).to(dtype)
    segments = [((0, 1), 3, [(0, 3, 0, 29)]), ((2, 8), 5, [(0, 2, 0, 21), (2, 5, 21, 50)]),
                ((9, 12), 1, [(0, 1, 7, 9)]), ((12, 23), 7, [(0, 7, 3, 40)])]
    expected, tables, weights = y.float(), [], []
    for (lo, hi), rank, layout in segments:
        a = torch.randn(rank, 37, generator=generator).to(dtype)
        b = torch.full((rank, 50), float("nan"))
        for r0, r1, c0, c1 in layout:
            b[r0:r1, c0:c1] = torch.randn(r1 - r0, c1 - c0, generator=generator)
            expected[lo:hi, c0:c1] += (x[lo:hi].float() @ a.float().t())[:, r0:r1] @ b[r0:r1, c0:c1].to(dtype).float()
        weights.append((a, pack_expand(b.to(dtype), layout), tuple(layout)))
        tables.append(weights_table([None, weights[-1]]))  # this adapter patches the second of two linears
    rows = torch.tensor([bounds for bounds, _, _ in segments])
    lora_add_(y[:7], x[:7], torch.stack(tables), rows, linear=1)  # x's rows in two calls, as the MLP's chunks
    lora_add_(y[7:], x[7:], torch.stack(tables), rows, linear=1, first_row=7)
    lora_add_(y, x, torch.stack(tables), rows, linear=0)  # unpatched: adds nothing
    with pytest.raises(RuntimeError, match="segment 0's weights do not fit"):  # B's columns past y's
        lora_add_(y[:, :20], x, torch.stack(tables), rows, linear=1)
    torch.testing.assert_close(y.float(), expected, atol=tolerance * 10, rtol=tolerance)
