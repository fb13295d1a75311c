"""Hostile bodies against a live server: N generated bodies (benchmarks/hostile_bodies.py) over real HTTP to the four
body-taking endpoints, counting 5xx answers, whether the replica restarted, the router's memory and what
`held_state` keeps, and that no KV block is held at the end. Writes benchmarks/results/fuzz.{json,md}.

`python -m kvloom.benchmarks.fuzz [--bodies 20000]`: a tiny random model with a chat template serves (every
check here is in the router and the engine's request checks, not the model's arithmetic)."""

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONCURRENCY = 4
WARMUP = 500  # bodies sent before the router's starting memory is read (imports, caches and pools warm up)


def draw_bodies(count: int, seed: int) -> list[tuple[str, dict]]:
    """`count` bodies spread over the endpoints, generated without shrinking (Hypothesis draws, nothing fails)."""
    from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
    from hypothesis import strategies as st

    from kvloom.benchmarks.hostile_bodies import ENDPOINTS, hostile

    drawn: list[tuple[str, dict]] = []
    endpoint = st.sampled_from(list(ENDPOINTS)).flatmap(
        lambda path: st.tuples(st.just(path), hostile(ENDPOINTS[path], "tiny")))

    @hypothesis_seed(seed)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(endpoint)
    def collect(pair):
        drawn.append(pair)

    collect()
    return drawn


async def send_all(base: str, bodies: list[tuple[str, dict]]) -> tuple[Counter, list[dict]]:
    statuses: Counter = Counter()
    failures: list[dict] = []
    queue = iter(bodies)

    async def worker(client: httpx.AsyncClient) -> None:
        for path, body in queue:
            response = await client.post(f"{base}{path}", content=json.dumps(body))
            statuses[response.status_code] += 1
            if response.status_code >= 500 or "internal_server_error" in response.text:
                failures.append({"path": path, "body": body, "status": response.status_code,
                                 "answer": response.text[:500]})

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=CONCURRENCY)) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return statuses, failures


def run(count: int, seed: int) -> dict:
    import platform

    from kvloom.benchmarks.source_commit import source_commit
    from kvloom.benchmarks.local_serve import local_serve
    from kvloom.benchmarks.tiny_model import build_tiny_llama
    from kvloom.cluster.app import deploy
    from kvloom.cluster.config import ClusterConfig
    from kvloom.kernels.host_isa import host_isa

    started = time.monotonic()
    bodies = draw_bodies(WARMUP + count, seed)
    drawn_s = time.monotonic() - started
    with tempfile.TemporaryDirectory() as tmp, local_serve() as base:
        model = build_tiny_llama(Path(tmp) / "tiny", chat=True)
        router = deploy(ClusterConfig.model_validate({
            "served_model_name": "tiny", "num_replicas": 1,
            "engine": {"model": str(model), "dtype": "float32", "kv_cache_memory_bytes": 16 << 20,
                       "max_model_len": 256, "max_num_seqs": 8}}))
        replicas_before = {s["replica_id"] for s in router.replica_stats.remote().result()}
        asyncio.run(send_all(base, bodies[:WARMUP]))
        held_start = router.held_state.remote().result()
        sent = time.monotonic()
        statuses, failures = asyncio.run(send_all(base, bodies[WARMUP:]))
        send_s = time.monotonic() - sent
        held_end = router.held_state.remote().result()
        deadline = time.monotonic() + 30
        while True:  # clients that finished their requests: every block back within moments
            stats = router.replica_stats.remote().result()
            if all(s["num_free_blocks"] == s["num_blocks"] for s in stats) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return {"commit": source_commit(), "machine": f"{platform.machine()}, {host_isa().describe()}",
            "bodies": count, "warmup_bodies": WARMUP, "seed": seed, "concurrency": CONCURRENCY,
            "draw_s": drawn_s, "send_s": send_s, "statuses": dict(sorted(statuses.items())),
            "failures": failures[:20], "num_5xx": sum(n for status, n in statuses.items() if status >= 500),
            "replica_restarted": {s["replica_id"] for s in stats} != replicas_before,
            "blocks_held_at_end": sum(s["num_blocks"] - s["num_free_blocks"] for s in stats),
            "held_start": held_start, "held_end": held_end,
            "rss_growth": held_end["rss_bytes"] / held_start["rss_bytes"] - 1}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(results, indent=2, default=str))
    r, start, end = results, results["held_start"], results["held_end"]
    met = lambda ok: "yes" if ok else "**no**"  # noqa: E731
    lines = [
        "# Hostile bodies against a live server",
        "",
        f"`python -m kvloom.benchmarks.fuzz --bodies {r['bodies']}` at {r['commit']} on {r['machine']}: "
        f"{r['bodies']} bodies generated from the request models' schemas (seed {r['seed']}; after {r['warmup_bodies']} "
        f"warm-up bodies) sent over HTTP, {r['concurrency']} at a time, in {r['send_s']:.0f} s, to one replica of a "
        "tiny random model.",
        "",
        "| goal | target | measured | met |",
        "|---|---|---|---|",
        f"| answers of 500 or more | 0 | {r['num_5xx']} | {met(r['num_5xx'] == 0)} |",
        f"| replica restarted | never | {'yes' if r['replica_restarted'] else 'never'} | "
        f"{met(not r['replica_restarted'])} |",
        f"| router RSS growth | within 5% | {r['rss_growth']:+.1%} ({start['rss_bytes'] / 2**20:.0f} -> "
        f"{end['rss_bytes'] / 2**20:.0f} MiB) | {met(abs(r['rss_growth']) <= 0.05)} |",
        f"| KV blocks held at the end | 0 | {r['blocks_held_at_end']} | {met(r['blocks_held_at_end'] == 0)} |",
        "",
        "Answers by status: " + ", ".join(f"{status}: {n}" for status, n in r["statuses"].items()) + ".",
        "",
        "What the router keeps that input could grow, at the start and the end: "
        + ", ".join(f"{k} {start[k]} -> {end[k]}" for k in start if k != "rss_bytes") + ".",
    ]
    if r["failures"]:
        lines += ["", "## 5xx answers (first 20)", ""]
        lines += [f"- `{f['path']}` {f['status']}: `{json.dumps(f['body'])[:300]}` -> {f['answer'][:200]}"
                  for f in r["failures"]]
    (out / "fuzz.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--bodies", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    results = run(args.bodies, args.seed)
    write_report(results, args.out)
    print(f"[fuzz] {results['bodies']} bodies: {results['num_5xx']} answers >= 500, replica restarted: "
          f"{results['replica_restarted']}, router RSS {results['rss_growth']:+.1%}; report: {args.out / 'fuzz.md'}")
    return 0 if results["num_5xx"] == 0 and not results["replica_restarted"] else 1


if __name__ == "__main__":
    sys.exit(main())
