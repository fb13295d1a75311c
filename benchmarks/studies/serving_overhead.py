"""Where `kvloom serve`'s CPU goes beside the engine: CPU time per streamed event, process by process.

The engine runs a tiny random Llama (2 layers, width 64), so a step costs a few milliseconds and the serving
path's own work is what fills the cores: the router's HTTP and server-sent events, the Ray messages from
replica to router, Serve's controller and proxy, Ray's daemons, and the client. 64 streams of `--tokens`
tokens each run at once (after one warm-up round); every thread's CPU time over the measured round, from
/proc, summed by process (the engine replica's engine threads, named `kvloom-engine`, apart from its others)
and divided by the events the client received. A W1 run with SmolLM2 streams ~9,000 events, so at the
router's ~150 us an event it costs ~1.4 CPU seconds; on a 2-core host, whatever the serving path uses, the
engine's two threads do not get.

    python -m kvloom.benchmarks.studies.serving_overhead    (~1 minute)

writes benchmarks/results/serving-overhead.md.
"""

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from kvloom.benchmarks.external_peers import healthy, kvloom_serve_command
from kvloom.benchmarks.process_tree import stop_tree, wait_for
from kvloom.benchmarks.serving_cpu import cpu_by_role, own_cpu_seconds, thread_cpu_seconds
from kvloom.benchmarks.tiny_model import build_tiny_llama
from kvloom.cluster.ports import free_port
from kvloom.kernels.host_isa import host_isa

RESULTS = Path(__file__).resolve().parents[1] / "results" / "serving-overhead.md"
STREAMS = 64


async def stream_all(base: str, tokens: int) -> int:
    """STREAMS concurrent streaming completions of `tokens` tokens; the events received."""
    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": "tiny", "prompt": " ".join(f"w{3 + (i * 7 + j) % 500}" for j in range(40)),
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        events = 0
        async with session.post(f"{base}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                events += line.startswith(b"data: {")
        return events

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return sum(await asyncio.gather(*(one(session, i) for i in range(STREAMS))))


def measure(tokens: int, scratch: Path) -> dict:
    model = build_tiny_llama(scratch / "tiny")
    port = free_port()
    config = {"name": "kvloom", "served_model_name": "tiny", "num_replicas": 1, "resources": {"num_cpus": 1},
              "engine": {"model": str(model), "device": "cpu", "max_num_seqs": STREAMS, "max_model_len": 1024,
                         "kv_cache_memory_bytes": 256 << 20},
              "http": {"host": "127.0.0.1", "port": port}}
    (scratch / "serve.yaml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    with (scratch / "serve.log").open("w") as log:
        server = subprocess.Popen(kvloom_serve_command(scratch / "serve.yaml"), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            if not wait_for(lambda: healthy(base), 300):
                raise RuntimeError(f"kvloom serve did not come up; see {scratch / 'serve.log'}")
            asyncio.run(stream_all(base, tokens))  # warm-up: code paths, allocator, oneDNN primitives
            time.sleep(2)
            before, client_before, start = thread_cpu_seconds(), own_cpu_seconds(), time.monotonic()
            events = asyncio.run(stream_all(base, tokens))
            wall, client_after, after = time.monotonic() - start, own_cpu_seconds(), thread_cpu_seconds()
        finally:
            stop_tree(server)
    by_role = cpu_by_role(before, after, os.getpid(), client_after - client_before)
    return {"events": events, "wall_s": wall, "cpu_s": by_role, "tokens": tokens}


def report(result: dict) -> str:
    events, wall = result["events"], result["wall_s"]
    rows = [f"| {name} | {cpu:.2f} | {cpu / events * 1e6:.0f} |"
            for name, cpu in sorted(result["cpu_s"].items(), key=lambda item: -item[1]) if cpu >= 0.005]
    return "\n".join([
        "# Serving-path CPU per streamed event",
        "",
        f"Host: {host_isa().describe()}, {os.cpu_count()} CPUs. `kvloom serve` (shipped defaults: direct ingress, one "
        f"replica with every CPU) on a tiny random Llama; {STREAMS} concurrent streaming completions of "
        f"{result['tokens']} tokens, after a warm-up round of the same. {events} events in {wall:.1f} s "
        f"({events / wall:.0f} a second). Regenerate: `python -m kvloom.benchmarks.studies.serving_overhead`.",
        "",
        "| process | CPU s | us per event |",
        "|---|---|---|",
        *rows,
        "",
        "The engine threads' row is the tiny model's steps (and their OpenMP spinning between ops); every other "
        "row is what serving costs beside an engine.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=400, help="tokens per stream")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        text = report(measure(args.tokens, Path(scratch)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
