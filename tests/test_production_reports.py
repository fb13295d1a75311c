"""The soak's and the conformance run's verdicts, computed from what they observed (no server needed here;
the runs themselves are committed reports, see benchmarks/studies/soak.py and benchmarks/studies/conformance.py)."""

from kvloom.benchmarks.studies.conformance import guidellm_command, guidellm_summary, write_report
from kvloom.benchmarks.studies.soak import Outcome, Sample, Soak, SoakPlan, replica_gauges, summarize, windows

PLAN = SoakPlan(minutes=20, warmup_minutes=5, window_minutes=5, sample_s=60)


def stream(start_s: float, ttft: float, e2e: float, tenant: str = "alice", ok: bool = True, tokens: int = 10):
    return Outcome("stream", tenant, start_s, ok=ok, status=200, ttft=ttft, e2e=e2e, completion_tokens=tokens)


def steady_soak(rss_end: float = 1010.0, late_ttft: float = 0.12) -> Soak:
    outcomes = [stream(s, 0.1, 1.0) for s in range(0, 900, 10)] + [stream(s, late_ttft, 1.1) for s in range(900, 1200, 10)]
    samples = [Sample(t, 1000.0 if t < 1140 else rss_end, 0.2, 4) for t in range(0, 1200, 60)]
    return Soak(outcomes, samples)


def test_windows_start_after_the_warm_up_and_hold_whole_streams_only():
    soak = steady_soak()
    soak.outcomes.append(stream(400, 9.0, 9.0, ok=False))  # lost: not a latency sample
    rows = windows(soak.outcomes, PLAN)
    assert [(r["from_s"], r["to_s"]) for r in rows] == [(300, 600), (600, 900), (900, 1200)]
    assert [r["requests"] for r in rows] == [30, 30, 30]
    assert abs(rows[0]["ttft_p99"] - 0.1) < 1e-9


def test_a_steady_soak_meets_every_goal():
    summary = summarize(steady_soak(), PLAN, usage={"alice": 1200, "bob": 0}, kv_after=0.0)
    assert all(summary["verdicts"].values()), summary["verdicts"]
    assert abs(summary["drift"]["ttft_p99"] - 1.2) < 1e-9 and summary["lost"] == 0


def test_losses_leaks_growth_drift_and_underbilling_each_fail_their_goal():
    soak = steady_soak(rss_end=1200.0, late_ttft=0.3)
    soak.outcomes.append(Outcome("bad", "bob", 50, ok=False, status=500, error="boom"))
    summary = summarize(soak, PLAN, usage={"alice": 10}, kv_after=0.05)
    assert not any(summary["verdicts"].values()), summary["verdicts"]
    assert summary["lost"] == 1 and summary["lost_examples"][0]["error"] == "boom"
    assert abs(summary["rss"]["growth"] - 0.2) < 1e-9


def test_replica_gauges_read_kvloom_metrics():
    text = ('kvloom:kv_cache_usage_perc{replica="a"} 0.25\nkvloom:kv_cache_usage_perc{replica="b"} 0.75\n'
            'kvloom:num_requests_running{replica="a"} 3.0\nkvloom:num_requests_running{replica="b"} 2.0\n')
    assert replica_gauges(text) == (0.5, 5)
    assert replica_gauges("") == (0.0, 0)


def test_guidellm_runs_a_fixed_concurrency_against_the_served_name_with_a_local_tokenizer(tmp_path):
    command = guidellm_command(tmp_path / "bin" / "python", "http://127.0.0.1:9", tmp_path / "model", 16,
                               tmp_path / "out.json")
    assert command[:2] == [str(tmp_path / "bin" / "guidellm"), "run"]
    assert command[command.index("--profile") + 1] == "kind=concurrent,streams=16"
    assert f"model={tmp_path / 'model'}" in command[command.index("--tokenizer") + 1]  # never a hub download


def test_guidellm_summary_reads_its_json_report():
    def stat(mean=0.0, median=0.0):
        return {"mean": mean, "median": median}

    doc = {"benchmarks": [{"metrics": {
        "request_totals": {"successful": 9, "errored": 1, "incomplete": 2, "total": 12},
        "output_tokens_per_second": {"successful": stat(50.0), "total": stat(55.5)},
        "time_to_first_token_ms": {"successful": stat(300.0, 250.0)}}}]}
    assert guidellm_summary(doc) == {"successful": 9, "errored": 1, "incomplete": 2, "output_tok_s": 55.5,
                                     "ttft_ms_p50": 250.0}


def test_the_conformance_report_shows_each_check_per_server_and_a_server_that_did_not_start(tmp_path):
    doc = {"environment": {"host": "h", "cpu": "c", "cpus": 2, "torch": "t", "transformers": "x", "threads": 2,
                           "omp_wait_policy": "PASSIVE", "auto_dtype": "float32",
                           "settings": {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 1 << 30,
                                        "enable_prefix_caching": True, "timeout_s": 600, "hf_cb_attention": "sdpa"}},
           "dtype": "float32", "clients": {"openai": "3", "litellm": "1", "guidellm": "0.8.1"}, "wall_s": 600,
           "servers": [
               {"server": "kvloom serve", "status": "ok", "guidellm": {"1": {"error": "guidellm exited 2"}},
                "checks": [{"check": "openai: models.list", "ok": True, "detail": "bench"},
                           {"check": "litellm: completion", "ok": False, "detail": "APIError: a|b"}]},
               {"server": "vllm serve", "status": "not set up: run `bash benchmarks/peer_setup/vllm.sh`"}]}
    text = write_report(doc, tmp_path).read_text()
    assert "| openai: models.list | pass | – |" in text
    assert "| litellm: completion | **FAIL** APIError: a\\|b | – |" in text
    assert "**FAIL** guidellm exited 2" in text and "vllm serve: not set up" in text
