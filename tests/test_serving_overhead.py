"""The serving-overhead benchmark names each process of a `kvloom serve` tree and divides its CPU by the events."""

from kvloom.benchmarks.serving_cpu import ENGINE_THREADS, beside_engine, cpu_by_role, role, serving_cpu_line
from kvloom.benchmarks.studies.serving_overhead import report


RAYLET = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x"
REPLICA = "ray::ServeReplica:kvloom:EngineReplica"


def test_processes_are_named_by_their_role_in_the_serving_path():
    assert role("ray::ServeReplica:kvloom:Router.handle_request_streaming", "ray::ServeRepli") == "router"
    assert role(REPLICA, "kvloom-engine") == ENGINE_THREADS
    assert role(REPLICA, "worker.io") == "engine replica: other threads"
    assert role(RAYLET, "raylet") == "raylet"
    assert role("ray::ProxyActor", "ray::ProxyActor") == "Serve proxy"
    assert role("python -m kvloom.cluster.cli serve --config serve.yaml", "python") == "`kvloom serve` driver"
    assert role("/usr/sbin/sshd -D", "sshd") == "other"


def test_the_report_gives_cpu_per_event_largest_first():
    text = report({"events": 20_000, "wall_s": 8.0, "tokens": 400,
                   "cpu_s": {"router": 3.0, ENGINE_THREADS: 7.0, "raylet": 0.001}})
    rows = [line for line in text.splitlines() if line.startswith("| ") and "process" not in line]
    assert rows == [f"| {ENGINE_THREADS} | 7.00 | 350 |", "| router | 3.00 | 150 |"]
    assert "20000 events in 8.0 s (2500 a second)" in text


def test_cpu_is_summed_by_role_between_snapshots_and_the_engine_is_kept_apart():
    before = {(10, 10): (REPLICA, "kvloom-engine", 5.0, 1), (10, 11): (REPLICA, "kvloom-engine", 5.0, 1),
              (10, 12): (REPLICA, "worker.io", 1.0, 1), (20, 20): ("ray::ServeReplica:kvloom:Router", "x", 2.0, 1),
              (30, 30): (RAYLET, "raylet", 0.5, 1), (99, 99): ("python bench", "python", 7.0, 1)}
    after = {**before, (10, 10): (REPLICA, "kvloom-engine", 9.0, 1), (10, 11): (REPLICA, "kvloom-engine", 8.5, 1),
             (10, 12): (REPLICA, "worker.io", 1.25, 1), (20, 20): ("ray::ServeReplica:kvloom:Router", "x", 3.5, 1),
             (30, 30): (RAYLET, "raylet", 0.501, 1), (99, 99): ("python bench", "python", 9.0, 1),
             (40, 40): ("ray::ProxyActor", "p", 3.0, 7)}  # started between the snapshots: not counted
    cpu = cpu_by_role(before, after, client_pid=99, client_s=0.75)
    assert cpu == {ENGINE_THREADS: 7.5, "router": 1.5, "client (the benchmark, aiohttp)": 0.75,
                   "engine replica: other threads": 0.25}
    assert beside_engine(cpu) == 2.5


def test_a_process_ray_retitles_mid_run_still_counts_and_a_reused_thread_id_does_not():
    before = {(20, 20): ("ray::ServeController", "x", 1.0, 5),
              (30, 30): ("ray::ServeReplica:kvloom:Router", "x", 2.0, 5)}
    after = {(20, 20): ("ray::ServeController.listen_for_change", "x", 1.75, 5),  # the method it runs now
             (30, 30): ("ray::ServeReplica:kvloom:Router", "x", 3.0, 9)}  # another thread under the same id
    assert cpu_by_role(before, after, client_pid=99, client_s=0.0) == {"Serve controller": 0.75}


def test_a_served_run_names_what_each_role_beside_the_engine_took():
    line = serving_cpu_line({ENGINE_THREADS: 50.04, "router": 1.9, "Serve controller": 0.45, "raylet": 0.01})
    assert line == "CPU during the run: engine threads 50.0 s; beside them 2.36 s (router 1.90, Serve controller 0.45)"
