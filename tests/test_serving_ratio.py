"""The serving-ratio benchmark judges `kvloom serve` against its offline engine by the median of alternated pairs."""

from kvloom.benchmarks.harness import BenchSettings
from kvloom.benchmarks.serving_cpu import ENGINE_THREADS
from kvloom.benchmarks.serving_ratio import median_ratio, report


def run(tok_s: float, steps: int = 257, step_ms: float | None = 100.0, cpu: dict | None = None) -> dict:
    return {"output_tok_s": tok_s, "wall_s": 8885 / tok_s, "steps": steps, "step_ms": step_ms, "cpu_by_role": cpu}


SERVED_CPU = {ENGINE_THREADS: 50.0, "router": 2.0, "Serve proxy": 0.3}


def test_the_ratio_is_the_median_of_the_pairs_that_both_ran():
    rows = [{"offline": run(400.0), "served": run(380.0)},  # 0.95
            {"offline": run(400.0), "served": run(320.0)},  # 0.80
            {"offline": run(400.0), "served": run(360.0)},  # 0.90
            {"offline": None, "served": run(390.0)}]  # the offline run failed: the pair does not count
    assert median_ratio(rows) == 0.9
    assert median_ratio([{"offline": run(400.0), "served": None}]) is None


def test_the_report_shows_every_pair_the_median_and_whose_cpu_the_served_runs_used():
    rows = [{"offline": run(360.0, step_ms=95.3), "served": run(315.0, 264, 106.3, SERVED_CPU)},
            {"offline": run(350.0), "served": None}]
    text = report(rows, "AMD EPYC [avx2]", BenchSettings())
    assert "| 0 | 360.0 | 257, 95.3 | 315.0 | 264, 106.3 | 0.875 | 2.30 |" in text
    assert "| 1 | 350.0 | 257, 100.0 | failed | – | – | – |" in text
    assert "Median served / offline: **0.875** (goal >= 0.9: **missed by 3%**)" in text
    assert "pair 0, served: CPU during the run: engine threads 50.0 s; beside them 2.30 s (router 2.00, Serve proxy 0.30)" in text


def test_no_pair_that_ran_both_is_not_measured_rather_than_met():
    text = report([{"offline": None, "served": None}], "cpu", BenchSettings())
    assert "goal >= 0.9: **not measured**" in text
