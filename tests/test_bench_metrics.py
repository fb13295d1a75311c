"""Benchmark lab: metrics from known timestamps, seeded workloads, replay on a tiny model, reports."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvloom.benchmarks.bench import compare_outputs
from kvloom.benchmarks.harness import SystemResult, SystemSpec
from kvloom.benchmarks.metrics import BatchCounters, LatencyStats, RequestRecord, RunMetrics, percentile, summarize
from kvloom.benchmarks.report import notes
from kvloom.benchmarks.sweep import parse_sweep, summarize_sweep
from kvloom.benchmarks.workloads import TokenCorpus, Workload, make_workload, synthetic_text
from kvloom.engine.model.model_config import ModelConfig


@pytest.fixture(scope="module")
def corpus() -> TokenCorpus:
    return TokenCorpus(np.arange(20_000, dtype=np.int64) % 4_000)


def record(name: str, arrival: float, times: list[float], prompt: int = 10) -> RequestRecord:
    return RequestRecord(name, prompt, list(range(len(times))), arrival, times[0], times[-1], token_times=times)


# ---- metrics ------------------------------------------------------------------------------------
def test_percentiles_interpolate_linearly():
    assert percentile([1, 2], 50) == 1.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([5.0], 90) == 5.0
    stats = LatencyStats.of([4.0, 1.0, 3.0, 2.0])
    assert (stats.mean, stats.p50, stats.p90) == (2.5, 2.5, pytest.approx(3.7))
    assert LatencyStats.of([]) is None


def test_request_latencies_from_timestamps():
    r = record("a", arrival=10.0, times=[10.5, 10.7, 10.9, 11.5])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((11.5 - 10.5) / 3)
    assert r.e2e == pytest.approx(1.5)
    assert r.itls == pytest.approx([0.2, 0.2, 0.6])
    single = record("b", arrival=0.0, times=[2.0])
    assert single.tpot is None and single.itls == [] and single.e2e == 2.0


def test_summarize_throughput_and_latency_distributions():
    records = [record("a", 0.0, [1.0, 2.0, 3.0], prompt=100), record("b", 1.0, [4.0, 5.0], prompt=50)]
    m = summarize("sys", records, wall_s=5.0)
    assert (m.prompt_tokens, m.output_tokens) == (150, 5)
    assert m.output_tok_s == pytest.approx(1.0)
    assert m.total_tok_s == pytest.approx(31.0)
    assert m.requests_s == pytest.approx(0.4)
    assert m.ttft.p50 == pytest.approx(2.0)  # ttfts 1 and 3
    assert m.tpot.mean == pytest.approx(1.0)
    assert m.e2e.p99 == pytest.approx(3.99)  # e2es 3 and 4: rank 0.99 of the way from 3 to 4
    assert m.itl.mean == pytest.approx(1.0)
    assert RunMetrics.from_dict(json.loads(json.dumps(m.__dict__, default=lambda o: o.__dict__))) == m


def test_batch_counters_ratios():
    c = BatchCounters(num_steps=10, busy_slot_steps=30, idle_slot_steps=10, padding_tokens=25, num_prompt_tokens=75)
    assert c.mean_batch_size == 3.0
    assert c.idle_ratio == 0.25
    assert c.padding_ratio == 0.25
    empty = BatchCounters()
    assert empty.mean_batch_size is None and empty.idle_ratio is None and empty.padding_ratio is None


def test_output_comparison_reports_where_outputs_diverge():
    def result(name: str, kind: str, outputs: dict) -> SystemResult:
        return SystemResult(SystemSpec(name, kind), "ok", None, [], outputs, 0.0)

    ref = result("continuous", "kvloom", {"a": [1, 2, 3], "b": [4, 5, 6]})
    peer = result("hf-cb", "hf-cb", {"a": [1, 2, 3], "b": [4, 9, 6], "c": [0]})
    report = compare_outputs([peer, ref])
    assert report["hf-cb"]["reference"] == "continuous"
    assert (report["hf-cb"]["compared"], report["hf-cb"]["equal"]) == (2, 1)
    assert report["hf-cb"]["mismatches"] == [{"id": "b", "first_diff": 1, "length": 3}]


# ---- workloads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["offline-mixed", "chat", "long-prefill", "shared-prefix", "single-stream",
                                  "copy-heavy"])
def test_workloads_are_seeded_and_reproducible(corpus, name):
    a, b = make_workload(name, corpus, seed=3), make_workload(name, corpus, seed=3)
    assert a.requests == b.requests
    assert make_workload(name, corpus, seed=4).requests != a.requests


def test_offline_mixed_matches_its_uniform_parameters(corpus):
    w = make_workload("offline-mixed", corpus, num_requests=4000)
    prompts = np.array([len(r.prompt) for r in w.requests])
    outputs = np.array([r.max_tokens for r in w.requests])
    assert prompts.min() >= 16 and prompts.max() <= 512 and outputs.min() >= 16 and outputs.max() <= 256
    assert prompts.mean() == pytest.approx(264, rel=0.03)
    assert outputs.mean() == pytest.approx(136, rel=0.03)
    assert all(r.arrival_s == 0 for r in w.requests)
    assert len(make_workload("offline-mixed", corpus).requests) == 64


def test_single_stream_sends_one_fixed_size_request_at_a_time(corpus):
    w = make_workload("single-stream", corpus)
    assert {(len(r.prompt), r.max_tokens) for r in w.requests} == {(256, 128)}
    assert np.diff([r.arrival_s for r in w.requests]).tolist() == [8.0] * 7


def test_chat_matches_its_lognormal_and_poisson_parameters(corpus):
    w = make_workload("chat", corpus, num_requests=4000, rate=2.0)
    prompts = np.array([len(r.prompt) for r in w.requests])
    outputs = np.array([r.max_tokens for r in w.requests])
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert prompts.mean() == pytest.approx(250, rel=0.05)
    assert outputs.mean() == pytest.approx(200, rel=0.05)
    assert np.median(prompts) < prompts.mean()  # right-skewed, like ShareGPT
    assert gaps.min() >= 0 and gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: std equals mean


def test_long_prefill_and_shared_prefix_shapes(corpus):
    long = make_workload("long-prefill", corpus, num_requests=30, num_long=3)
    longs = [r for r in long.requests if len(r.prompt) >= 2048]
    assert len(longs) == 3 and all(len(r.prompt) <= 4096 for r in longs)
    assert long.requests[0] not in longs
    shared = make_workload("shared-prefix", corpus, num_requests=8)
    prefix = shared.requests[0].prompt[:1024]
    assert all(r.prompt[:1024] == prefix and 16 <= len(r.prompt) - 1024 <= 128 for r in shared.requests)


def test_copy_heavy_answers_are_in_their_prompts(corpus):
    """Rewrite, extract and code edit in turn; what each answer copies is in its prompt, and max_tokens
    is about the answer's length."""
    w = make_workload("copy-heavy", corpus, num_requests=6)
    kinds = [r.prompt.split(" ", 1)[0] for r in w.requests]
    assert kinds == ["Rewrite", "Copy", "Rename"] * 2
    rewrite, extract, code = w.requests[:3]
    passage = rewrite.prompt.split("Text:\n")[1].split("\n\nRewritten text:")[0]
    assert passage.startswith("The ") and passage.count(".") >= 8
    records = extract.prompt.split("Records:\n")[1].split("\n\n")[0].splitlines()
    assert any("city: river" in r for r in records) and any("city: river" not in r for r in records)
    assert code.prompt.count("def ") >= 2 and code.prompt.endswith("```python\n")
    assert all(16 <= r.max_tokens <= len(r.prompt) // 3 for r in w.requests)


def test_workload_jsonl_round_trip(tmp_path, corpus):
    w = make_workload("chat", corpus, num_requests=5, rate=1.0)
    loaded = Workload.load(w.save(tmp_path / "chat.jsonl"))
    assert loaded.requests == w.requests
    text = Workload("t", [w.requests[0].__class__("x", "hello world", 4)])
    assert text.tokenized(lambda s: [len(s)]).requests[0].prompt == [11]


def test_synthetic_corpus_is_deterministic_prose():
    text = synthetic_text(500)
    assert text == synthetic_text(500) and text != synthetic_text(500, seed=1)
    assert text.count(".") + text.count("?") + text.count("!") > 10 and len(text.split()) == 500


# ---- sweep --------------------------------------------------------------------------------------
def test_sweep_parsing_and_best_setting_under_budget():
    assert parse_sweep("max_num_seqs=1,4,16") == ("max_num_seqs", [1, 4, 16])
    with pytest.raises(ValueError):
        parse_sweep("dtype=1,2")

    def result(value: int, tok_s: float, tpot: float) -> dict:
        m = {"output_tok_s": tok_s, "tpot": {"p99": tpot}, "ttft": {"p99": 1.0}, "mean_batch_size": value}
        return {"spec": {"name": f"max_num_seqs={value}"}, "metrics": m}

    run = {"label": "x", "num_requests": 8, "results": [result(1, 10, 0.05), result(4, 30, 0.1), result(16, 50, 0.3)]}
    sweep = summarize_sweep(run, "max_num_seqs", [1, 4, 16], tpot_budget_s=0.2)
    assert sweep["best"]["value"] == 4
    assert summarize_sweep(run, "max_num_seqs", [1, 4, 16], tpot_budget_s=0.01)["best"] is None


# ---- replay on a tiny model ---------------------------------------------------------------------
def test_replay_honours_arrivals_and_forces_output_lengths(tiny_model_dir):
    from kvloom.benchmarks.replay import replay, strategy_config
    from kvloom.benchmarks.workloads import WorkloadRequest
    from kvloom.engine.llm_engine import LLMEngine

    requests = [WorkloadRequest("a", [5] * 12, 6), WorkloadRequest("b", [7] * 30, 3, arrival_s=0.3),
                WorkloadRequest("c", [9] * 20, 1, arrival_s=0.3)]
    workload = Workload("tiny", requests)
    engine = LLMEngine(strategy_config("continuous", workload, model=str(tiny_model_dir), block_size=4,
                                       max_num_batched_tokens=64, max_model_len=64))
    engine.warm_up()
    result = replay(engine, workload)
    by_id = {r.request_id: r for r in result.records}
    assert [by_id[k].num_output_tokens for k in "abc"] == [6, 3, 1]
    t0 = by_id["a"].arrival
    assert by_id["b"].arrival == pytest.approx(t0 + 0.3) and by_id["b"].first_token >= t0 + 0.3
    assert all(len(r.token_times) == r.num_output_tokens and r.ttft >= 0 for r in result.records)
    assert result.wall_s >= 0.3 and result.counters.num_steps == len(result.steps)
    assert result.counters.idle_slot_steps == 0 and 0 < result.forward_fraction <= 1


# ---- report -------------------------------------------------------------------------------------
def test_report_renders_tables_and_plots(tmp_path):
    from dataclasses import asdict

    from kvloom.benchmarks.report import write_bench_report

    records = [record("a", 0.0, [1.0, 1.5, 2.0]), record("b", 0.0, [1.2, 2.2])]
    runs = []
    for rate in (0.5, 1.0):
        results = [{"spec": asdict(SystemSpec(name, "kvloom")), "status": "ok",
                    "metrics": asdict(summarize(name, records, 2.0 * rate)),
                    "requests": [{"id": r.request_id, "prompt": 10, "output": 2, "ttft": r.ttft, "tpot": r.tpot,
                                  "e2e": r.e2e} for r in records], "outputs": {}, "elapsed_s": 1.0}
                   for name in ("continuous", "static")]
        runs.append({"label": f"chat @ {rate}", "workload": "chat", "params": {"rate": rate}, "num_requests": 2,
                     "output_tokens": 5, "results": results,
                     "equality": {"static": {"reference": "continuous", "compared": 2, "equal": 1,
                                             "mismatches": [{"id": "b", "first_diff": 1, "length": 2}]}}})
    env = {"host": "h", "commit": "0123456789ab", "cpus": 2, "torch": "t", "transformers": "x", "threads": 2,
           "omp_wait_policy": "PASSIVE",
           "settings": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 2 << 30,
                        "enable_prefix_caching": True, "timeout_s": 600, "hf_cb_attention": "sdpa"}}
    md = write_bench_report({"title": "chat", "environment": env, "runs": runs, "roofline_system": "continuous"},
                            tmp_path).read_text()
    assert "kvloom `0123456789ab` on machine `h`" in md
    assert "| continuous | ok | 2 |" in md and "1 of 2 outputs differ" in md and "b at token 1/2" in md
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "bench-0-throughput.png", "bench-0-latency.png", "bench-1-throughput.png", "bench-1-latency.png",
        "bench-rates.png"}
    assert json.loads((tmp_path / "bench.json").read_text())["title"] == "chat"


def test_a_report_names_the_commit_it_was_made_from():
    from kvloom.benchmarks.source_commit import source_commit

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert source_commit().removesuffix("-dirty") == head.stdout.strip()


# ---- roofline -----------------------------------------------------------------------------------
SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=30, vocab=49152)


def test_model_flops_count_linears_head_and_attention():
    from kvloom.benchmarks.roofline import ModelShape, workload_flops
    from kvloom.benchmarks.workloads import WorkloadRequest

    shape = ModelShape(**SMOLLM2)
    assert shape.linear_params == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)  # 106.2M
    assert shape.attention_flops(0, 3) == 4 * 9 * 64 * 30 * (1 + 2 + 3)
    flops = workload_flops(Workload("w", [WorkloadRequest("a", [1, 2], 3)]), shape)
    token, head = 2 * shape.linear_params, 2 * 576 * 49152
    assert flops.prefill == 2 * token + shape.attention_flops(0, 2) + head
    assert flops.decode == 2 * (token + head) + shape.attention_flops(2, 4)  # 3 outputs: 2 more tokens fed


def test_decode_probe_uses_decode_only_steps_near_the_batch():
    from kvloom.benchmarks.roofline import ModelShape, decode_probe

    def step(batch: int, tokens: int, context: int, step_s: float) -> dict:
        return {"batch_size": batch, "num_tokens": tokens, "context_tokens": context, "step_s": step_s,
                "forward_s": 0.9 * step_s, "cpu_s": step_s}

    shape = ModelShape(**SMOLLM2)
    steps = [step(64, 2000, 9000, 5.0), step(64, 64, 64 * 300, 1.0), step(64, 64, 64 * 310, 1.2),
             step(30, 30, 30 * 400, 0.5)]
    probe = decode_probe(steps, shape, 64)
    assert probe.num_steps == 2 and probe.step_s == pytest.approx(1.1) and probe.context == pytest.approx(305)
    expected = 64 * (2 * shape.linear_params + 2 * 576 * 49152) + 4 * 9 * 64 * 30 * 64 * 305
    assert probe.flops_per_step == pytest.approx(expected)
    assert probe.overhead == pytest.approx(0.1)
    assert probe.flops_per_cpu_s(threads=2) == pytest.approx(2 * probe.flops_per_s)
    assert decode_probe(steps, shape, 32, tolerance=4).num_steps == 1
    assert decode_probe(steps, shape, 8) is None


def test_paired_decode_probe_alternates_real_steps_and_gemms(tiny_model_dir):
    from kvloom.benchmarks.roofline import ModelShape, paired_decode_probe

    probe = paired_decode_probe(str(tiny_model_dir), threads=1, batch=4, context=20, rounds=2, steps_per_round=2)
    assert len(probe["step_s"]) == 4 and len(probe["gemm_rates"]) == 2
    assert probe["best_step_s"] == min(probe["step_s"]) and probe["gemm_rate"] == max(probe["gemm_rates"])
    shape = ModelShape.of(ModelConfig.from_dir(tiny_model_dir))
    # the best step is one of the four: 4 requests of 22-25 keys (prefill gave 21 tokens, one decode step untimed)
    per_token = shape.token_flops() + shape.head_flops()
    keys = (probe["flops_per_step"] - 4 * per_token) / (4 * shape.heads * shape.head_dim * shape.layers)
    assert keys in {4 * 22 + 4 * k for k in range(4)}
    assert probe["efficiency"] == pytest.approx(probe["flops_per_step"] / probe["best_step_s"] / probe["gemm_rate"])


PAIRED_PROBE = {"efficiency": 0.65, "median_efficiency": 0.55, "best_step_s": 0.2, "context": 256,
                "flops_per_s": 6.5e10, "gemm_rate": 1e11}


# ---- goals --------------------------------------------------------------------------------------
def test_goals_compare_the_right_systems_and_say_when_unmeasured():
    from kvloom.benchmarks.goals import chat_goal, long_prefill_goal, prefix_goal, w1_goals, w1_time_goal

    def run(rate=None, **systems) -> dict:
        results = [{"spec": {"name": name, "kind": "hf-cb" if name.startswith("hf") else "kvloom",
                             "num_requests": None}, "metrics": metrics} for name, metrics in systems.items()]
        return {"results": results, "params": {"rate": rate}}

    w1 = run(continuous={"output_tok_s": 90.0, "wall_s": 100.0, "peak_rss_mb": 3000.0},
             **{"hf-cb": {"output_tok_s": 30.0}, "hf-static-8": {"output_tok_s": 20.0}})
    machine = {"roofline_s": 40.0, "weights_mb": 500.0, "probes": [
        {"target_batch": 64, "efficiency": 0.3, "flops_per_s": 3e10, "gemm_rate": 1e11, "overhead": 0.01,
         "step_s": 1.0, "forward_s": 0.99},
        {"target_batch": 32, "efficiency": 0.5, "flops_per_s": 5e10, "gemm_rate": 1e11, "overhead": 0.2,
         "step_s": 0.5, "forward_s": 0.4}]}
    goals = {g.name: g for g in w1_goals(w1, machine, 2 << 30, threads=2)}
    assert goals["W1 throughput vs peers"].met and "hf-cb" in goals["W1 throughput vs peers"].measured
    assert goals["W1 vs compute roofline"].met is False  # 2.5x
    assert goals["decode efficiency at batch 64"].met is False
    assert goals["engine overhead at batch 32"].met is False
    assert goals["peak RSS on W1"].met is True  # 3000 <= 500 + 2048 + 500
    decode = {g.name: g for g in w1_goals(w1, machine, 2 << 30, threads=2, decode_probe=PAIRED_PROBE)}
    assert decode["decode efficiency at batch 64"].met  # the paired probe decides, not the run's 30%
    assert "median vs median 55%" in decode["decode efficiency at batch 64"].measured
    chats = [run(0.1, continuous={"output_tok_s": 10.0}, dynamic={"output_tok_s": 10.0}),
             run(1.0, continuous={"output_tok_s": 50.0}, dynamic={"output_tok_s": 20.0})]
    assert chat_goal(chats).met and "1.0 req/s" in chat_goal(chats).measured
    long = run(continuous={"tpot": {"p99": 0.5}}, **{"continuous+chunked": {"tpot": {"p99": 0.3}}})
    assert long_prefill_goal(long).met
    assert long_prefill_goal(run(continuous={"tpot": {"p99": 0.5}})).met is None
    shared = run(on={"output_tok_s": 30.0, "prefix_hit_rate": 0.8}, off={"output_tok_s": 10.0})
    assert prefix_goal(shared, "on", "off").met and "3.00x" in prefix_goal(shared, "on", "off").measured
    assert w1_time_goal(14.5 * 60).met and "0.5 min under" in w1_time_goal(14.5 * 60).measured
    assert w1_time_goal(16 * 60).met is False and w1_time_goal(None).met is None


def fake_run_systems(workload, systems, settings, out_dir, label, budget_s=None) -> dict:
    """run_systems without running anything: each system is a little slower than the one before."""
    from dataclasses import asdict

    results = []
    for i, spec in enumerate(systems):
        recs = [record(r.request_id, r.arrival_s, [r.arrival_s + 1 + i + k * 0.1 for k in range(r.max_tokens)],
                       len(r.prompt)) for r in workload.requests[: spec.num_requests]]
        m = summarize(spec.name, recs, 10.0 + i, peak_rss_mb=3000.0, prefix_hit_rate=0.5)
        results.append({"spec": asdict(spec), "status": "ok", "metrics": asdict(m), "requests": [],
                        "outputs": {}, "elapsed_s": 1.0, "steps": []})
    return {"label": label, "workload": workload.name, "params": workload.params,
            "num_requests": len(workload.requests), "output_tokens": workload.num_output_tokens,
            "results": results, "equality": {}}


MACHINE = {"decode_rate": 1e11, "prefill_rate": 2e11, "decode_m": 64, "prefill_m": 256, "rate_m32": 9e10,
           "prefill_flops": 4e12, "decode_flops": 3e12, "roofline_s": 30.0, "weights_mb": 513.0, "probes": []}


def test_suite_renders_every_section_from_fake_runs(tmp_path, monkeypatch, corpus):
    """The hour-long suite must not die at the end: drive it with instant fake systems."""
    from kvloom.benchmarks import suite
    from kvloom.benchmarks.harness import BenchSettings

    monkeypatch.setattr(suite, "run_systems", fake_run_systems)
    monkeypatch.setattr(suite, "machine_section", lambda *args: MACHINE)
    monkeypatch.setattr(suite, "in_fresh_process", lambda fn, *args: PAIRED_PROBE)  # only the paired probe
    monkeypatch.setattr(suite, "default_corpus", lambda model: corpus)
    monkeypatch.setattr(suite, "OUT_ROOT", tmp_path / "scratch")
    (tmp_path / "scratch" / "suite").mkdir(parents=True)
    md = suite.run_suite(BenchSettings(), tmp_path / "results").read_text()
    for heading in ("## Goals", "## W1", "## Roofline", "## `chat`", "## long-prefill", "## shared-prefix",
                    "## Sweep of `max_num_seqs`"):
        assert heading in md
    assert "hf-static-32" in md
    assert "alternated in one process" in md
    assert "| W1 in one command | every strategy, both peers and the roofline within 15 min | 0.1 min" in md
    committed = json.loads((tmp_path / "results" / "cpu.json").read_text())
    assert all(r["outputs"] == {} and r["steps"] == [] for r in committed["w1"]["results"])
    assert len(list((tmp_path / "results").glob("*.png"))) >= 10


def test_time_budget_keeps_a_reserve_for_every_system_still_to_run(tmp_path, monkeypatch, corpus):
    from kvloom.benchmarks import bench
    from kvloom.benchmarks.harness import BenchSettings

    limits = []

    def fake_isolated(spec, path, settings, out_dir, limit_s):
        limits.append(limit_s)
        return SystemResult(spec, "ok", None, [], {}, 0.0)

    monkeypatch.setattr(bench, "run_isolated", fake_isolated)
    systems = bench.make_systems(["static", "continuous"], ["hf-cb"])
    assert [s.name for s in systems] == ["continuous", "hf-cb", "static"]  # reference and peers first
    workload = make_workload("offline-mixed", corpus, num_requests=2)
    bench.run_systems(workload, systems, BenchSettings(timeout_s=1000), tmp_path, budget_s=300)
    assert limits == pytest.approx([300 - 2 * bench.RESERVE_S, 300 - bench.RESERVE_S, 300], abs=1)
    bench.run_systems(workload, systems, BenchSettings(timeout_s=100), tmp_path, budget_s=300)
    assert limits[3:] == [100, 100, 100]  # the per-system limit still applies


@pytest.mark.parametrize("extra", [{"sweep": "max_num_seqs=1,4,16"}, {"rates": [0.5, 1.0], "workload": "chat"}, {}])
def test_bench_command_writes_json_markdown_and_plots(tmp_path, monkeypatch, corpus, extra):
    from kvloom.benchmarks import command
    from kvloom.benchmarks.command import BenchOptions

    monkeypatch.setattr(command, "run_systems", fake_run_systems)
    monkeypatch.setattr(command, "machine_section", lambda *args: MACHINE)
    monkeypatch.setattr(command, "default_corpus", lambda model: corpus)
    md = command.run_bench(BenchOptions(out=tmp_path, tpot_budget_ms=1e6, **extra)).read_text()
    doc = json.loads((tmp_path / "bench.json").read_text())
    if "sweep" in extra:
        assert doc["sweep"]["best"]["value"] == 1 and "**max_num_seqs=1**" in md  # the fakes slow down with i
        assert (tmp_path / "bench-tradeoff.png").exists() and "machine" not in doc
    elif "rates" in extra:
        assert [run["params"]["rate"] for run in doc["runs"]] == [0.5, 1.0] and (tmp_path / "bench-rates.png").exists()
    else:
        assert [r["spec"]["name"] for r in doc["runs"][0]["results"]][:2] == ["continuous", "hf-cb"]
        assert "## Roofline" in md and (tmp_path / "bench-throughput.png").exists()


def test_the_report_says_how_busy_a_kvloom_engine_was_and_at_what_batch():
    ran = {"notes": [], "num_steps": 180, "mean_batch_size": 34.6, "engine_busy_s": 50.4, "wall_s": 60.0}
    run = {"results": [{"spec": {"name": "kvloom-serve"}, "status": "ok", "metrics": ran},
                       {"spec": {"name": "vllm-serve"}, "status": "ok", "metrics": {"notes": []}}]}
    assert notes(run) == "- kvloom-serve: engine 180 steps, mean batch 34.6, in steps 50.4 s of the run's 60.0 (280 ms a step)"
