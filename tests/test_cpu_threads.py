"""Thread counts and OpenMP waiting for CPU engines: an even split of a node's cores, and kvloom's spin
default that never overrides an operator's own choice."""

import os
import threading
from pathlib import Path

import pytest
import torch

from kvloom.engine import cpu_threads


@pytest.mark.parametrize("cpus, replicas, threads", [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 3, 5), (8, 0, 8)])
def test_replicas_on_a_node_split_its_cpus_evenly(cpus, replicas, threads):
    assert cpu_threads.share_of_node(cpus, replicas) == threads


def test_default_spin_is_set_where_nothing_was_chosen(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cpu_threads.openmp_env() == {"GOMP_SPINCOUNT": "300000"}


def test_an_operators_spin_count_is_kept(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert cpu_threads.openmp_env() == {"GOMP_SPINCOUNT": "1000"}


def test_an_operators_wait_policy_is_not_overridden(monkeypatch):
    """GOMP_SPINCOUNT takes precedence over OMP_WAIT_POLICY in libgomp, so kvloom must not add one."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cpu_threads.openmp_env() == {}


@pytest.mark.host("proc-threads")
def test_an_engine_thread_and_the_openmp_workers_it_starts_carry_its_name():
    def engine_thread():
        cpu_threads.name_os_thread(cpu_threads.ENGINE_THREAD_NAME)
        torch.set_num_threads(2)
        torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel region: its workers start here
        seen.extend(Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task"))

    seen: list[str] = []
    threads = torch.get_num_threads()
    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    torch.set_num_threads(threads)
    assert seen.count(cpu_threads.ENGINE_THREAD_NAME) >= 2, seen  # the thread and at least one OpenMP worker


@pytest.mark.host("sched-batch")
def test_an_engine_thread_leaves_the_batch_class_and_its_workers_start_in_the_normal_one():
    """`kvloom serve`'s Ray cluster runs as SCHED_BATCH; an engine's threads must still preempt it when they wake."""
    def engine_thread():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # inherited from the process, as in a replica
        seen.append(os.sched_getscheduler(0))
        cpu_threads.schedule_normally()
        seen.append(os.sched_getscheduler(0))
        worker = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        worker.start()
        worker.join()

    seen: list[int] = []
    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_BATCH, os.SCHED_OTHER, os.SCHED_OTHER]
