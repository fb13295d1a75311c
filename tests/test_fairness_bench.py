"""The fairness benchmark's analysis on hand-made client records (the run itself is `python -m
kvloom.benchmarks.fairness`; it needs minutes, not a unit test)."""

import json

import pytest

from kvloom.benchmarks import fairness
from kvloom.benchmarks.fairness import Params, Record, both_backlogged_windows, percentile, service_in_windows


def served(tenant: str, sent: float, first: float, tokens: int = 2, prompt: int = 4) -> Record:
    return Record(tenant, sent, 200, first, first + tokens, [first + i for i in range(tokens)], prompt, tokens)


def test_backlogged_windows_are_where_both_wait_for_a_first_token():
    records = [served("A", 0.0, 10.0), served("B", 5.0, 12.0), served("B", 20.0, 21.0)]
    assert both_backlogged_windows(records) == [(5.0, 10.0)]


def test_service_gap_counts_only_while_both_are_backlogged():
    # A (three requests sent at 0) stays backlogged until its last first token at 8.5; B waits from 1 to 9.
    # Inside (1, 8.5): A's prompts (4) and tokens (x w_out 2) at 2, 3, 5, 6, 8.5; B gets nothing.
    records = [served("A", 0.0, 2.0), served("A", 0.0, 5.0), served("A", 0.0, 8.5), served("B", 1.0, 9.0),
               served("A", 20.0, 30.0)]
    result = service_in_windows(records, {"A": 1.0, "B": 1.0})
    assert result["max_gap"] == pytest.approx(22.0)
    assert result["raw_service"] == {"A": 22.0, "B": 0.0}


def test_gap_is_per_unit_of_weight():
    records = [served("A", 0.0, 2.0), served("B", 1.0, 9.0)]  # window (1, 2): A's prompt and first token
    assert service_in_windows(records, {"A": 2.0, "B": 1.0})["max_gap"] == pytest.approx((4 + 2) / 2)


def test_percentile_is_nearest_rank():
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0], 99) == 3.0


def test_report_files(tmp_path):
    params = Params(phase_s=4)
    ttft = {"sent": 3, "served": 3, "ttft_p50_s": 0.2, "ttft_p99_s": 0.3}
    phase = {"ttft": {"A": ttft, "B": ttft}, "service": {"max_gap": 10.0, "raw_service": {"A": 20.0, "B": 10.0}},
             "throughput": {"A": [1.0, 2.0], "B": [0.5, 0.5]}, "engine_preemptions": 1,
             "load_avg": [1.0, 1.5]}
    results = {"params": fairness.asdict(params), "capacity_rps": 2.0, "rates": {"A": 10.0, "B": 0.5}, "bin_s": 2.0,
               "phases": {p.name: phase for p in fairness.phases()},
               "goals": {"b_p99_ratio": {"fcfs": 9.0, "fair_no_preemption": 3.0, "fair": 1.2}, "vtc_bound": 128,
                         "vtc_bound_batch": 320, "weighted_ratio": 2.0},
               "machine": "test", "wall_s": 1.0}
    results["notes"] = fairness.notes(results)
    fairness.write_report(results, tmp_path)
    report = (tmp_path / "fairness.md").read_text()
    assert "| B's p99 TTFT under A's flood vs B alone | <= 2x | 1.20x" in report and "**no**" not in report
    assert json.loads((tmp_path / "fairness.json").read_text())["goals"]["weighted_ratio"] == 2.0
    assert (tmp_path / "fairness.png").stat().st_size > 1000


def test_the_reading_follows_the_figures_it_reads():
    """A gap over the bound is read as exceeding it (the report once said "stays within" next to 144 > 128)."""
    ttft = {"sent": 3, "served": 3, "ttft_p50_s": 0.2, "ttft_p99_s": 0.3}
    results = {"params": fairness.asdict(Params(phase_s=4)), "goals": {
        "b_p99_ratio": {"fcfs": 9.0, "fair_no_preemption": 3.0, "fair": 1.2}, "vtc_bound": 128,
        "weighted_ratio": 2.0}}
    for gap, reading in ((144.0, "(144) exceeds 2 x the largest request (128)"),
                         (40.0, "(40) stays within 2 x the largest request (128)")):
        phase = {"ttft": {"A": ttft, "B": ttft}, "service": {"max_gap": gap}}
        results["phases"] = {p.name: phase for p in fairness.phases()}
        assert reading in "\n".join(fairness.notes(results))


def test_kvloom_bench_multi_tenant_runs_this_benchmark(monkeypatch, tmp_path):
    from kvloom.cluster import cli

    calls = []
    monkeypatch.setattr(fairness, "main", lambda argv: calls.append(argv) or 0)
    assert cli.main(["bench", "--workload", "multi-tenant", "--out", str(tmp_path)]) == 0
    assert calls == [["--out", str(tmp_path)]]
