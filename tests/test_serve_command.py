"""`kvloom serve`, the command a user runs: it starts its own Ray cluster and the router answers HTTP on the
configured port itself (Serve's direct ingress), with no proxy hop in between. Real processes, real HTTP."""

import os
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from kvloom.benchmarks.process_tree import stop_tree, wait_for
from kvloom.cluster.ports import free_port

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
"""


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def listener(port: int) -> psutil.Process:
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN")
    return psutil.Process(pid)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    config = tmp_path_factory.mktemp("serve") / "serve.yaml"
    config.write_text(CONFIG.format(port=port))
    log = config.with_suffix(".log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, not the tests' one
    process = subprocess.Popen([sys.executable, "-m", "kvloom.cluster.cli", "serve", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: healthy(base) or process.poll() is not None, 240) and process.poll() is None, \
            config.with_suffix(".log").read_text()[-3000:]
        yield base, port, config.with_suffix(".log")
    finally:
        stop_tree(process)


def test_the_router_itself_listens_on_the_configured_port(served):
    _, port, _ = served
    assert "Router" in " ".join(listener(port).cmdline())


def test_a_streamed_chat_reaches_the_client_through_the_direct_port(served):
    base, _, log = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=12, temperature=0)
    assert "".join(pieces) == whole.choices[0].message.content and whole.usage.completion_tokens == 12
    assert "kvloom is serving smollm2" in log.read_text()
