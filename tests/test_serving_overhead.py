"""The serving-overhead benchmark names each process of a `kvloom serve` tree and divides its CPU by the events."""

from kvloom.benchmarks.serving_overhead import report, role


RAYLET = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x"
REPLICA = "ray::ServeReplica:kvloom:EngineReplica"


def test_processes_are_named_by_their_role_in_the_serving_path():
    assert role("ray::ServeReplica:kvloom:Router.handle_request_streaming", "ray::ServeRepli") == "router"
    assert role(REPLICA, "kvloom-engine") == "engine replica: engine threads (tiny model)"
    assert role(REPLICA, "worker.io") == "engine replica: other threads"
    assert role(RAYLET, "raylet") == "raylet"
    assert role("ray::ProxyActor", "ray::ProxyActor") == "Serve proxy"
    assert role("python -m kvloom.cluster.cli serve --config serve.yaml", "python") == "`kvloom serve` driver"
    assert role("/usr/sbin/sshd -D", "sshd") == "other"


def test_the_report_gives_cpu_per_event_largest_first():
    text = report({"events": 20_000, "wall_s": 8.0, "tokens": 400,
                   "cpu_s": {"router": 3.0, "engine replica: engine threads (tiny model)": 7.0, "raylet": 0.001}})
    rows = [line for line in text.splitlines() if line.startswith("| ") and "process" not in line]
    assert rows == ["| engine replica: engine threads (tiny model) | 7.00 | 350 |", "| router | 3.00 | 150 |"]
    assert "20000 events in 8.0 s (2500 a second)" in text
