"""`kvloom serve` with a tensor-parallel replica (2 ranks on gloo, in one placement group on the local Ray
cluster): it streams what the offline engine generates, `kvloom status` shows the replica's ranks and where they
run, and killing a rank's process mid-stream kills the replica's engine: Serve replaces the replica and the router
continues the stream on the replacement. Real processes, real HTTP; SmolLM2 cut to four layers (its three KV heads
split two and one, a third of the compute)."""

import os
import re
import signal
import subprocess
import sys
import threading

import openai
import psutil
import pytest

from kvloom.benchmarks.process_tree import stop_tree, wait_for
from kvloom.cluster.ports import free_port
from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-4-layers"
CONFIG = """
name: kvloom
served_model_name: smollm2-4-layers
engine:
  model: {model}
  dtype: float32
  kv_cache_memory_bytes: 67108864
  max_model_len: 1024
  max_num_seqs: 8
  tensor_parallel_size: 2
  distributed_timeout_s: 10
resources:
  num_cpus: 0.5
http:
  port: {port}
"""
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def served(tmp_path_factory, serve_process, smollm2_4_layers_dir):
    port = free_port()
    process, log = serve_process(tmp_path_factory.mktemp("serve-tp"),
                                 CONFIG.format(port=port, model=smollm2_4_layers_dir))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    def ready() -> bool:
        try:
            return bool(client.models.list().data)
        except openai.OpenAIError:
            return False

    try:
        assert wait_for(lambda: process.poll() is not None or ("kvloom is serving" in log.read_text() and ready()),
                        300, period_s=0.5) and process.poll() is None, log.read_text()[-3000:]
        yield client, log, process
    finally:
        stop_tree(process)


def status(log) -> str:
    """`kvloom status` against the cluster this `kvloom serve` started (its log names it; other tests' clusters
    may still be up, so "auto" could find one of them)."""
    address = re.search(r"kvloom status --address (\S+)", log.read_text()).group(1)
    done = subprocess.run([sys.executable, "-m", "kvloom.cluster.cli", "status", "--address", address],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def rank_workers(serve: subprocess.Popen) -> list[psutil.Process]:
    """The tensor-parallel worker processes of this `kvloom serve`'s cluster."""
    found = []
    for child in psutil.Process(serve.pid).children(recursive=True):
        try:
            if "ray::TensorParallelWorker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # it ended meanwhile
            continue
    return found


@pytest.fixture(scope="module")
def offline_text(smollm2_4_layers_dir):
    """What one rank generates for PROMPT, greedy, with `ignore_eos`: max_tokens -> text."""
    llm = LLM(str(smollm2_4_layers_dir), dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    return lambda max_tokens: llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True))[0].outputs[0].text


def test_a_streamed_completion_equals_the_offline_engine(served, offline_text):
    client, log, _ = served
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == offline_text(24)
    assert "on each of 2 tensor-parallel ranks" in log.read_text()


def test_status_shows_one_replica_with_its_ranks_their_placement_its_start_and_its_arrival(served):
    shown = status(served[1])
    assert "1 replica(s)" in shown
    lines = shown.splitlines()
    assert lines[2].split()[3] == "2"  # the tp column
    ranks = [line.strip() for line in lines if line.strip().startswith("rank ")]
    assert [r.split(":")[0] for r in ranks] == ["rank 0", "rank 1"]
    assert "KV heads 0-1 (2 of 3)" in ranks[0] and "KV heads 2-2 (1 of 3)" in ranks[1]  # the uneven split
    assert all(" node " in f" {r}" for r in ranks)
    started = next(line.strip() for line in lines if line.strip().startswith("started in "))
    assert all(phase in started for phase in ("process start", "model files and tokenizer", "ranks", "warm-up"))
    joined = lines[lines.index("replicas over time (the router's load signals when each joined or left):") + 1]
    assert " 1 replica(s)  +" in joined and "waiting/replica" in joined  # the replica's arrival, logged


def test_killing_a_rank_mid_stream_continues_on_the_replacement_serve_brings_back(served, offline_text):
    client, log, process = served
    workers = rank_workers(process)
    assert len(workers) == 1
    got: dict = {"chunks": []}

    def long_stream():
        try:
            for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, stream=True,
                                                   temperature=0, extra_body={"ignore_eos": True}):
                if chunk.choices:
                    got["chunks"].append(chunk.choices[0])
            got["finish"] = got["chunks"][-1].finish_reason
        except openai.OpenAIError as exc:
            got["error"] = str(exc)

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert wait_for(lambda: len(got["chunks"]) >= 3, 60)  # mid-stream
    os.kill(workers[0].pid, signal.SIGKILL)
    thread.join(timeout=240)
    assert not thread.is_alive()
    # the engine died with its rank; the router took that as its replica gone and, once Serve had replaced the
    # replica, continued the stream there from the tokens the client had: nothing lost, nothing repeated
    assert "error" not in got and got["finish"] == "length", got.get("error")
    assert "".join(c.text for c in got["chunks"]) == offline_text(64)
    assert wait_for(lambda: [w.pid for w in rank_workers(process)] not in ([], [workers[0].pid]), 240, period_s=1)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.usage.completion_tokens == 8
    assert "1 replica(s)" in status(log)
