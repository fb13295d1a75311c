"""Tensor parallelism on CPU over gloo: how a model splits, that each rank loads and holds only its share, and
that SmolLM2 (cut to four of its layers: its shapes and tokenizer at a third of the compute) split over 2 ranks
(uneven: two GQA groups and one) and 3 ranks (one group each) generates what one rank does, under chunked
prefill, preemption and prefix-cache hits.

Reduction order differs from one rank's GEMMs, so a greedy near-tie may flip: a divergence is accepted only where
the single-rank run's top two candidates are within NEAR_TIE nats, and no more than one per run (measured here:
none on these 12 prompts in float32).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import ConfigError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.block_table import BlockTable
from kvloom.engine.step_plan import HostStaging, StepInputs
from kvloom.engine.tensor_parallel.tp_group import TensorParallelError
from kvloom.engine.tensor_parallel.tp_shards import ShardedCheckpoint, plan_shards
from kvloom.kernels.metadata import AttentionMetadata

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=2)
NEAR_TIE = 1e-3
BLOCKS = 44  # with max_model_len 704: room for one long request, far less than the batch needs (preemption)


# ---- how a model splits ---------------------------------------------------------------------------------------
def test_smollm2_on_three_ranks_is_one_gqa_group_each(smollm2_dir):
    shards = plan_shards(ModelConfig.from_dir(smollm2_dir), 3)
    assert [s.heads for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2), (2, 3)]
    assert [s.intermediate for s in shards] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [s.vocab for s in shards] == [(0, 16384), (16384, 32768), (32768, 49152)]


def test_smollm2_on_two_ranks_splits_its_three_groups_two_and_one(smollm2_dir):
    shards = plan_shards(ModelConfig.from_dir(smollm2_dir), 2)
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 3)]
    assert [s.heads for s in shards] == [(0, 6), (6, 9)]  # each rank's query heads read its own KV heads
    assert [s.intermediate for s in shards] == [(0, 768), (768, 1536)]  # the MLP and vocabulary still split evenly
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 49152)]


def test_more_ranks_than_kv_heads_replicate_each_kv_head(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)  # 4 query heads in 2 groups
    shards = plan_shards(config, 4)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("ranks, reason", [(5, "at least one head"), (3, "multiple of 2")])
def test_a_split_that_cannot_work_is_refused_naming_the_field(tiny_model_dir, ranks, reason):
    with pytest.raises(ConfigError, match=f"tensor_parallel_size.*{reason}"):
        plan_shards(ModelConfig.from_dir(tiny_model_dir), ranks)


def test_a_rank_reads_only_its_slices(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    full = Checkpoint.open(tiny_model_dir, torch.float32, torch.device("cpu"))
    shard = plan_shards(config, 2)[1]
    sharded = ShardedCheckpoint(full, shard, config)
    d = config.head_dim
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(sharded.get(q), full.get(q)[2 * d:4 * d])
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(sharded.get(o), full.get(o)[:, 2 * d:4 * d])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(sharded.get(down), full.get(down)[:, 64:128])
    assert torch.equal(sharded.get("model.embed_tokens.weight"), full.get("model.embed_tokens.weight")[256:512])
    norm = "model.norm.weight"
    assert torch.equal(sharded.get(norm), full.get(norm))


def test_a_step_plan_survives_its_compact_form():
    """Built from host lists in one packed buffer (what the runner does each step), it equals the metadata built
    field by field, and its compact form (what a tensor-parallel driver broadcasts) decodes back to it."""
    tables = [[4, 9], [1, 2, 5]]
    meta = AttentionMetadata.build([3, 1], [7, 12], tables, 4)
    padded = BlockTable().step(["a", "b"], tables)
    inputs = StepInputs.build([5, 6, 7, 8], [4, 5, 6, 11], [3, 1], [7, 12], tables, padded, [2, 3], 4,
                              HostStaging(torch.device("cpu")))
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        built, expected = getattr(inputs.meta, name), getattr(meta, name)
        assert torch.equal(built, expected) and built.dtype == expected.dtype, name
    header, body = inputs.encode()
    back = StepInputs.decode(header.tolist(), body, torch.device("cpu"))
    assert torch.equal(back.input_ids, inputs.input_ids) and torch.equal(back.sample_rows, inputs.sample_rows)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(back.meta, name), getattr(meta, name)), name
    assert (back.meta.query_lens, back.meta.seq_lens_host, back.meta.max_seq_len) == ([3, 1], [7, 12], 12)


@pytest.mark.parametrize("knobs, field", [({"model_impl": "transformers"}, "model_impl"),
                                          ({"speculative_config": {"method": "layer_skip", "num_speculative_tokens": 2,
                                                                   "draft_layers": 4}}, "layer_skip")])
def test_tensor_parallelism_refuses_what_it_cannot_shard(knobs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(tensor_parallel_size=2, **knobs)


# ---- SmolLM2 (four of its layers) on 1, 2 and 3 ranks --------------------------------------------------------
def per_rank_budget(model_dir, ranks: int) -> int:
    config = ModelConfig.from_dir(model_dir)
    widest = max(s.local_config(config).kv_bytes_per_token(torch.float32) for s in plan_shards(config, ranks))
    return BLOCKS * 16 * widest


def make_engine(model_dir, ranks: int, **knobs) -> LLMEngine:
    return LLMEngine(**{"dtype": "float32", "model": str(model_dir), "max_model_len": 704,
                        "max_num_batched_tokens": 128, "max_num_seqs": 16, "tensor_parallel_size": ranks,
                        "kv_cache_memory_bytes": per_rank_budget(model_dir, ranks), "distributed_timeout_s": 20,
                        **knobs})


@pytest.fixture(scope="module")
def prompts(smollm2_prompts):
    """12 of them: 8 chat-templated sharing a system prompt (up to ~600 tokens) and the 4 raw ones."""
    return smollm2_prompts[4:]


def run(engine, prompts, drive):
    """Prompt 0 first; the rest two steps later, when its system prompt's blocks are cached."""
    outputs = drive(engine, prompts, GREEDY, {0: [0], 2: list(range(1, len(prompts)))})
    return [o.outputs[0] for o in outputs], engine.stats()


@pytest.fixture(scope="module")
def single_rank(smollm2_4_layers_dir, prompts, drive):
    engine = make_engine(smollm2_4_layers_dir, 1)
    return run(engine, prompts, drive) + (engine.decoder.weight_bytes(),)


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def sharded(request, smollm2_4_layers_dir, prompts, drive):
    engine = make_engine(smollm2_4_layers_dir, request.param)
    yield request.param, engine, *run(engine, prompts, drive)
    engine.shutdown()


def divergences(reference, outputs) -> list[tuple[int, int, float]]:
    """(request, token index, reference's top-2 gap) wherever the token sequences part."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        if ref.token_ids == out.token_ids:
            continue
        at = next(k for k, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b)
        chosen = ref.logprobs[at]
        gap = chosen[ref.token_ids[at]] - chosen.get(out.token_ids[at], float("-inf"))
        found.append((i, at, gap))
    return found


def test_greedy_outputs_equal_one_rank_under_chunking_preemption_and_prefix_hits(single_rank, sharded, prompts):
    reference, reference_stats, _ = single_rank
    ranks, engine, outputs, stats = sharded
    assert max(len(p) for p in prompts) > 128  # chunked: a step takes at most 128 prompt tokens
    assert stats.num_preemptions > 0 and reference_stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    parted = divergences(reference, outputs)
    assert len(parted) <= 1 and all(gap < NEAR_TIE for _, _, gap in parted), parted
    assert all(len(o.token_ids) == MAX_NEW for o in outputs)


def test_each_rank_holds_its_share_of_the_weights_and_only_its_kv_heads(single_rank, sharded, smollm2_4_layers_dir):
    whole = single_rank[2]
    ranks, engine, *_ = sharded
    reports = engine.runner.reports
    assert len(reports) == ranks
    shares = [r.weight_bytes / whole for r in reports]
    # the norms (0.03% of the model) are on every rank; the rest splits: TP=3 evenly; TP=2 two thirds of the
    # attention weights on rank 0 (6 of 9 query heads, 2 of 3 KV heads) and half of everything else
    config = ModelConfig.from_dir(smollm2_4_layers_dir)
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    attention = 4 * config.num_hidden_layers * hidden * config.head_dim * 2 * (heads + kv_heads)  # float32 bytes
    rank0_of_two = (attention * 2 / 3 + (whole - attention) / 2) / whole
    expected = {2: [rank0_of_two, 1 - rank0_of_two], 3: [1 / 3] * 3}[ranks]
    assert shares == pytest.approx(expected, abs=0.002)
    per_head = 2 * config.num_hidden_layers * engine.num_blocks * 16 * config.head_dim * 4
    assert [r.kv_bytes for r in reports] == [r.shard.num_kv_heads * per_head for r in reports]
    assert engine.runner.kv_caches[0][0].shape[2] == reports[0].shard.num_kv_heads


def test_an_abort_mid_step_frees_every_rank_s_blocks(sharded, prompts):
    ranks, engine, *_ = sharded
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"abort-{i}", prompts[i], params)
    for _ in range(3):
        engine.step()
    assert engine.abort("abort-1").outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_free_blocks == engine.num_blocks  # one pool on rank 0 stands for every rank's


def test_a_dead_worker_fails_the_next_step_naming_its_rank(smollm2_4_layers_dir, prompts):
    engine = make_engine(smollm2_4_layers_dir, 2, distributed_timeout_s=5)
    worker = engine.runner.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(TensorParallelError, match="rank 1"):
        engine.runner.check_health()
    engine.add_request("after", prompts[0], SamplingParams(max_tokens=2))
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 0, step 1"):
        engine.step()
    assert time.monotonic() - started < 10  # the group's timeout bounds it: no hang
    engine.shutdown()


def test_a_script_without_a_main_guard_is_told_so_at_once_instead_of_waiting_out_the_timeout(tmp_path, tiny_model_dir):
    """Local ranks are spawned processes that import the main script again: without the guard a rank dies in that
    import, and rank 0 says so, naming the guard and the rank's exit, instead of waiting the group's whole timeout
    (600 s here, past this test's limit) for it to join."""
    script = tmp_path / "unguarded.py"
    script.write_text("from kvloom.engine.llm import LLM\n"
                      f"LLM(model={str(tiny_model_dir)!r}, dtype='float32', tensor_parallel_size=2, "
                      "distributed_timeout_s=600)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "TensorParallelError: tensor-parallel rank 1" in last and "exited with code 1 before joining" in last, last
    assert 'if __name__ == "__main__":' in last


def test_the_nvlink_prediction_shows_its_arithmetic():
    from kvloom.benchmarks.studies.tensor_parallel import NCCL_LATENCY_S, NVLINK_BYTES_PER_S, predict_nvlink

    row = {"collectives": {"all-reduce": {"ms": 80.0, "calls": 61, "bytes": 61 * 147_456},
                           "logits gather": {"ms": 8.0, "calls": 1, "bytes": 6_291_456},
                           "step plan": {"ms": 1.0, "calls": 2, "bytes": 8_000}}}
    predicted = predict_nvlink(row, ranks=2)
    # ring all-reduce on 2 GPUs: each sends 2(N-1)/N = 1 buffer per call
    assert predicted["all-reduce"]["ms"] == pytest.approx(61 * (NCCL_LATENCY_S + 147_456 / NVLINK_BYTES_PER_S) * 1e3)
    assert predicted["all-reduce"]["arithmetic"] == "61 x (10 us + 1 x 147.5 KB / 450 GB/s)"
    four = predict_nvlink(row, ranks=4)["all-reduce"]["ms"]
    assert four == pytest.approx(61 * (NCCL_LATENCY_S + 1.5 * 147_456 / NVLINK_BYTES_PER_S) * 1e3)


# ---- KV hand-off between replicas of different sizes (disaggregated prefill -> decode) -------------------------
@pytest.fixture(scope="module")
def tiny_engines(tiny_model_dir):
    """The tiny model (2 KV heads) on 1 rank, 2 ranks (a KV head each) and 4 (each KV head on two ranks)."""
    make = lambda ranks: LLMEngine(model=str(tiny_model_dir), dtype="float32", block_size=4,  # noqa: E731
                                   kv_cache_memory_bytes=4 << 20, tensor_parallel_size=ranks, distributed_timeout_s=20)
    engines = {ranks: make(ranks) for ranks in (1, 2, 4)}
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.parametrize("prefill_ranks, decode_ranks", [(2, 1), (1, 2), (4, 2)])
def test_kv_handed_between_different_sizes_decodes_what_one_engine_does(tiny_engines, prefill_ranks, decode_ranks):
    from kvloom.engine.kv_handoff import KVHeader, export_kv, import_kv

    prompt = [(7 * i) % 500 + 3 for i in range(11)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    colocated = tiny_engines[1]
    colocated.add_request("whole", prompt, params)
    while colocated.has_unfinished():
        done = [o for o in colocated.step() if o.finished]
    expected = done[0].outputs[0].token_ids

    prefill, decode = tiny_engines[prefill_ranks], tiny_engines[decode_ranks]
    request = prefill.make_request("p", prompt, params.model_copy(update={"max_tokens": 1}))
    request.park_kv = True
    prefill.add_prepared(request)
    while prefill.has_unfinished():
        first = prefill.step()
    header, payload = export_kv(prefill, "p")
    assert payload.shape[4] == 2  # every KV head leaves, whichever ranks held it
    header.check_matches(KVHeader.for_engine(decode, len(prompt)))
    assert import_kv(decode, decode.make_request("d", prompt, params), first[0].outputs[0].token_ids[0], payload)
    prefill.release_parked("p")
    outputs = []
    while decode.has_unfinished():
        outputs.extend(o for o in decode.step() if o.finished)
    assert outputs[0].outputs[0].token_ids == expected
    assert all(e.stats().num_free_blocks == e.num_blocks for e in tiny_engines.values())
