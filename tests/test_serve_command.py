"""`kvloom serve`, the command a user runs: it starts its own Ray cluster, the router answers HTTP on the
configured port itself (Serve's direct ingress, no proxy hop), /health is a quiet 503 until a replica is
ready, and SIGTERM drains: new requests get 503 while the ones in flight finish, then everything it started
exits; started again at once it serves on the same port, and a port another program holds is one clear line.
With `--log-format json` every console line is a JSON object. Real processes, real HTTP."""

import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from kvloom.benchmarks.process_tree import stop_tree, wait_for
from kvloom.cluster.ports import free_port
from kvloom.engine.cpu_threads import ENGINE_THREAD_NAME

pytestmark = pytest.mark.slow

CONFIG = """
name: kvloom
engine:
  model: smollm2
  dtype: float32  # greedy text identical whatever the batch and prefix-cache hits (bf16 GEMMs differ by shape)
  kv_cache_memory_bytes: 67108864
  max_model_len: 1024
  max_num_seqs: 8
http:
  port: {port}
  drain_timeout_s: 60
"""


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log) -> None:
        self.process, self.port, self.log = process, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.health_answers: list[tuple[int, dict]] = []  # every /health answer until the first 200
        self.idle_client: socket.socket | None = None  # a client's keep-alive connection, open when it stops

    def healthy(self) -> bool:
        try:
            response = httpx.get(f"{self.base}/health", timeout=2)
        except httpx.HTTPError:
            return False
        self.health_answers.append((response.status_code, response.json()))
        return response.status_code == 200


def listener(port: int) -> psutil.Process:
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN")
    return psutil.Process(pid)


@pytest.fixture(scope="module")
def served(tmp_path_factory, serve_process):
    port = free_port()
    process, log = serve_process(tmp_path_factory.mktemp("serve"), CONFIG.format(port=port), "--log-format", "json")
    server = Server(process, port, log)
    try:
        assert wait_for(lambda: server.healthy() or process.poll() is not None, 240, period_s=0.2) \
            and process.poll() is None, log.read_text()[-3000:]
        yield server
    finally:
        stop_tree(process)


def test_the_router_itself_listens_on_the_configured_port(served):
    assert "Router" in " ".join(listener(served.port).cmdline())


def test_health_is_a_quiet_503_until_a_replica_is_ready(served):
    for status, body in served.health_answers[:-1]:
        assert status == 503 and body["error"]["code"] == "no_replicas"
    assert served.health_answers[-1][0] == 200
    assert "Traceback" not in served.log.read_text()


def test_a_streamed_chat_reaches_the_client_through_the_direct_port(served):
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say hello."}]
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    assert "".join(pieces) == whole.choices[0].message.content and whole.usage.completion_tokens == 12
    # the replica may serve before the command prints its summary (it asks every replica for its figures)
    assert wait_for(lambda: "kvloom is serving smollm2" in served.log.read_text(), 60, period_s=0.2)
    log = served.log.read_text()
    assert "KV blocks" in log
    assert "report_replica_stats" not in log and "submit" not in log  # no access-log line per internal call


def scheduling_classes(process: psutil.Process) -> dict[tuple[str, str], set[int]]:
    """The scheduling classes of the threads of `process` and the processes under it, by (command line, thread name)."""
    classes: dict[tuple[str, str], set[int]] = {}
    for member in [process, *process.children(recursive=True)]:
        try:
            command, threads = " ".join(member.cmdline()), member.threads()
            for thread in threads:
                name = Path(f"/proc/{member.pid}/task/{thread.id}/comm").read_text().strip()
                classes.setdefault((command, name), set()).add(os.sched_getscheduler(thread.id))
        except (psutil.NoSuchProcess, ProcessLookupError, FileNotFoundError):  # it ended meanwhile
            continue
    return classes


@pytest.mark.host("sched-batch")
def test_its_own_ray_cluster_runs_as_sched_batch_and_only_the_engine_in_the_normal_class(served):
    """Ray's threads that wake (signal checks, polls, each streamed step's hops) wait for a free core or the next
    tick instead of preempting the engine's, whose own wake-ups still preempt them. Every process the command
    starts inherits the class from it; the engine's thread leaves it, and its workers start outside it."""
    classes = scheduling_classes(psutil.Process(served.process.pid))
    engine = {c for (command, name), found in classes.items() if name == ENGINE_THREAD_NAME for c in found}
    rest = {c for (command, name), found in classes.items() if name != ENGINE_THREAD_NAME for c in found}
    started = " ".join(command for command, _ in classes)
    assert "EngineReplica" in started and "Router" in started and "raylet" in started
    assert engine == {os.SCHED_OTHER} and rest == {os.SCHED_BATCH}
    assert "SCHED_BATCH" in served.log.read_text()


def test_sigterm_drains_in_flight_requests_then_everything_exits(served):
    tree = [psutil.Process(served.process.pid), *psutil.Process(served.process.pid).children(recursive=True)]
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    streamed = {}

    def long_stream():
        chunks = [c for c in client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=120,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
                  if c.choices]
        streamed["text"] = "".join(c.choices[0].text for c in chunks)
        streamed["finish"] = chunks[-1].choices[0].finish_reason

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert wait_for(lambda: _gauge(served.base, "kvloom:num_requests_running") > 0, 30, period_s=0.05)
    served.idle_client = socket.create_connection(("127.0.0.1", served.port))  # answered, then left open
    served.idle_client.sendall(b"GET /health HTTP/1.1\r\nHost: kvloom\r\n\r\n")
    assert served.idle_client.recv(65536).startswith(b"HTTP/1.1 200")
    served.process.send_signal(signal.SIGTERM)
    assert wait_for(lambda: _status(served.base, "/health") == 503, 10, period_s=0.05)
    late = httpx.post(f"{served.base}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2})
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    reader.join(120)
    assert streamed["finish"] == "length" and streamed["text"]
    assert served.process.wait(120) == 0
    assert wait_for(lambda: not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30)
    assert "drain" in served.log.read_text()


def test_with_log_format_json_every_console_line_is_a_json_object(served):
    """Ray's lines, Serve's, the replicas' and kvloom's own, from start to the drained exit (the test above)."""
    def parsed(line: str):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            return None

    lines = [line for line in served.log.read_text().splitlines() if line.strip()]
    assert lines and all(isinstance(parsed(line), dict) for line in lines), \
        [line for line in lines if not isinstance(parsed(line), dict)][:5]
    replicas = [parsed(line) for line in lines if '"kv_blocks"' in line]
    assert len(replicas) == 1 and replicas[0]["kv_blocks"] > 0 and replicas[0]["dtype"] == "float32"
    assert any(parsed(line)["message"].startswith("draining") for line in lines)


def test_started_again_at_once_on_the_same_port_it_serves(served, serve_process, tmp_path):
    """The sequence a user hits: a client held a keep-alive connection, SIGTERM stopped the server (the test above),
    and `kvloom serve` starts again at once, while the connection the server closed still holds the port."""
    assert served.process.poll() is not None and served.idle_client is not None
    closed = [c for c in psutil.net_connections("tcp") if c.laddr.port == served.port and c.status != "LISTEN"]
    assert closed, "the stopped server left no closed connection on its port: the scenario is not reproduced"
    process, log = serve_process(tmp_path, CONFIG.format(port=served.port))
    again = Server(process, served.port, log)
    try:
        assert wait_for(lambda: again.healthy() or process.poll() is not None, 240, period_s=0.2) \
            and process.poll() is None, log.read_text()[-3000:]
        answer = httpx.post(f"{again.base}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    finally:
        stop_tree(process)
        served.idle_client.close()
    assert "Failed to bind" not in log.read_text()


def test_a_port_another_program_listens_on_is_one_line_naming_it_not_a_traceback(serve_process, tmp_path):
    port = free_port()
    with socket.socket() as other_program:
        other_program.bind(("127.0.0.1", port))
        other_program.listen()
        process, log = serve_process(tmp_path, CONFIG.format(port=port))
        assert process.wait(60) == 1
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "http.port" in lines[0] and "serve.yaml" in lines[0], lines


def test_a_stop_during_start_up_answers_the_requests_the_router_took_with_503(serve_process, tmp_path):
    """The router answers HTTP before a replica is ready (here none ever is: it asks for more CPUs than the cluster
    has). /v1/models says so as /health does, and a SIGTERM then answers a request waiting for a replica with a
    503 instead of dropping its connection."""
    port = free_port()
    process, log = serve_process(tmp_path, CONFIG.format(port=port) + "resources:\n  num_cpus: 64\n")
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _status(base, "/health") == 503 or process.poll() is not None, 120, period_s=0.2) \
            and process.poll() is None, log.read_text()[-3000:]
        models = httpx.get(f"{base}/v1/models")
        assert models.status_code == 503 and models.json()["error"]["code"] == "no_replicas"
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{base}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2}, timeout=60)))
        waiter.start()
        assert wait_for(lambda: _gauge(base, "kvloom:router_queue_length") == 1, 30, period_s=0.05)
        process.send_signal(signal.SIGTERM)
        waiter.join(60)
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "draining"
        assert process.wait(60) == 0
    finally:
        stop_tree(process)


def _status(base: str, path: str) -> int | None:
    try:
        return httpx.get(f"{base}{path}", timeout=2).status_code
    except httpx.HTTPError:
        return None


def _gauge(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0
