"""The neighbour-cost benchmark sets the engine's lost throughput against the CPU its neighbours took."""

import subprocess
import sys
import time

import pytest

from kvloom.benchmarks.studies.neighbour_cost import NEIGHBOUR, Round, report, summarize
from kvloom.benchmarks.serving_cpu import process_cpu_seconds


def test_amplification_is_the_lost_throughput_over_the_neighbours_share_of_the_machine():
    rounds = [Round(False, 10.0, [0.100] * 100, 0.0), Round(True, 12.5, [0.125] * 100, 2.5),
              Round(False, 10.0, [0.100] * 100, 0.0), Round(True, 12.5, [0.125] * 100, 2.5)]
    m = summarize(rounds, cores=2)
    assert m["share"] == pytest.approx(0.1)  # 5 CPU seconds of 2 cores x 25 s
    assert m["lost"] == pytest.approx(0.2)  # 20 s of work took 25
    assert m["amplification"] == pytest.approx(2.0)
    assert m["lost_by_pair"] == pytest.approx([0.2, 0.2])
    assert (m["quiet_step_ms"], m["noisy_step_ms"]) == pytest.approx((100.0, 125.0))


def test_the_report_gives_the_share_the_loss_and_their_ratio():
    m = {**summarize([Round(False, 10.0, [0.1], 0.0), Round(True, 11.0, [0.11], 1.1)], cores=2),
         "batch": 48, "rounds": 1, "steps": 1, "cores": 2, "threads": 2, "dtype": "bfloat16"}
    assert "| 100.0 ms | 110.0 ms | 5.0% | 9.1% | 1.82x |" in report(m)


@pytest.mark.host("proc-threads")
def test_a_neighbour_spins_its_bursts_and_sleeps_between_them():
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, "0.01", "0.01"])  # half of a core
    try:
        time.sleep(0.3)
        before, start = process_cpu_seconds(proc.pid), time.monotonic()
        time.sleep(1.0)
        share = (process_cpu_seconds(proc.pid) - before) / (time.monotonic() - start)
    finally:
        proc.kill()
        proc.wait()
    assert 0.25 < share < 0.75
