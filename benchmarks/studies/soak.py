"""Soak: `kvloom serve` under 30 minutes of mixed traffic from two tenants on loopback, watched from outside.

Bounded client loops (a fixed number of workers, each one request at a time, seeded) send streamed chats,
whole completions (n = 1 or 2), streams the client walks away from after a few events, and bad requests
(which must be 400s). Every few seconds the server's whole process tree RSS and the replicas' KV usage
are sampled. The report says whether anything was lost (a request that should have succeeded and did
not, or a bad one not answered 400), how RSS and KV usage moved after the warm-up, how the p99 latencies
drifted from the first window after the warm-up to the last, and whether each tenant's usage covers
what its clients received; with a plot.

    python -m kvloom.benchmarks.studies.soak      (30 minutes plus start-up; writes benchmarks/results/soak.{md,json,png})
"""

import argparse
import asyncio
import json
import random
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvloom.benchmarks.bench import environment
from kvloom.benchmarks.external_peers import HERE, SERVED_NAME, running_server
from kvloom.benchmarks.harness import BenchSettings, SystemSpec
from kvloom.benchmarks.process_tree import tree_rss_mb, wait_for
from kvloom.benchmarks.report import environment_lines, pyplot

RESULTS_DIR = HERE / "results"
RUNS_DIR = HERE / "out" / "soak"
ADMIN = "sk-soak-admin"
TENANTS = {"alice": "sk-soak-alice", "bob": "sk-soak-bob"}
MIX = {"stream": 0.45, "whole": 0.25, "walk_away": 0.15, "bad": 0.15}
PROMPTS = ["Write a haiku about", "Explain in two sentences why", "List three facts about", "Tell a short story of"]
TOPICS = ["the sea", "autumn", "a lighthouse", "bread", "trains", "the moon", "a library", "rain"]
RSS_GROWTH_LIMIT = 0.05  # after the warm-up, the tree's RSS may move by this share of its size
DRIFT_LIMIT = 1.5  # the last window's p99 over the first one's (after the warm-up)


@dataclass(frozen=True)
class SoakPlan:
    minutes: float = 30.0
    warmup_minutes: float = 5.0
    window_minutes: float = 5.0
    workers: int = 12
    sample_s: float = 5.0
    seed: int = 0


@dataclass
class Outcome:
    """One request as its client saw it."""

    kind: str
    tenant: str
    start: float  # seconds since the soak began
    ok: bool = False  # ended as it should: whole output, or (bad requests) a 400 naming the problem
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    completion_tokens: int = 0  # as the response's usage says (0 for a walk-away or an error)
    error: str | None = None


@dataclass
class Sample:
    t: float
    rss_mb: float
    kv_usage: float  # mean over replicas
    running: int


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


# ---- traffic -------------------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return f"{rng.choice(PROMPTS)} {rng.choice(TOPICS)}."


async def _stream(client: httpx.AsyncClient, path: str, body: dict, headers: dict, out: Outcome, t0: float,
                  walk_away_after: int | None = None) -> None:
    events = 0
    async with client.stream("POST", path, json=body, headers=headers) as response:
        out.status = response.status_code
        if response.status_code != 200:
            out.error = (await response.aread()).decode()[:300]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.ok = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out.error = json.dumps(event["error"])[:300]
                return
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and out.ttft is None:
                out.ttft = time.monotonic() - t0
            events += 1
            if walk_away_after is not None and events >= walk_away_after:
                out.ok = True  # leaving was the point: the server must free what it held
                return


async def one_request(client: httpx.AsyncClient, kind: str, tenant: str, rng: random.Random, start: float) -> Outcome:
    out = Outcome(kind, tenant, start)
    headers = {"Authorization": f"Bearer {TENANTS[tenant]}"}
    t0 = time.monotonic()
    try:
        if kind in ("stream", "walk_away"):
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": _prompt(rng)}],
                    "max_tokens": rng.randint(16, 128), "temperature": rng.choice([0, 0.8]), "stream": True,
                    "stream_options": {"include_usage": True}}
            await _stream(client, "/v1/chat/completions", body, headers, out, t0,
                          rng.randint(1, 5) if kind == "walk_away" else None)
        elif kind == "whole":
            body = {"model": SERVED_NAME, "prompt": _prompt(rng), "max_tokens": rng.randint(8, 64),
                    "n": rng.choice([1, 2]), "temperature": 0.7, "seed": rng.randrange(1000)}
            response = await client.post("/v1/completions", json=body, headers=headers)
            out.status = response.status_code
            if response.status_code == 200:
                out.completion_tokens = response.json()["usage"]["completion_tokens"]
                out.ok = out.completion_tokens > 0
            else:
                out.error = response.text[:300]
        else:  # a bad request: the client's mistake must be a 400 naming it, and cost nothing else
            body, param = rng.choice([({"max_tokens": -1}, "max_tokens"), ({"temperature": "hot"}, "temperature"),
                                      ({"prompt": ""}, "prompt"), ({"max_tokens": 10**6}, "max_tokens")])
            response = await client.post("/v1/completions", headers=headers,
                                         json={"model": SERVED_NAME, "prompt": _prompt(rng), **body})
            out.status = response.status_code
            out.ok = response.status_code == 400 and param in json.dumps(response.json().get("error", {}))
            if not out.ok:
                out.error = response.text[:300]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = repr(exc)[:300]
    out.e2e = time.monotonic() - t0
    return out


async def traffic(base: str, plan: SoakPlan, soak: Soak, began: float) -> None:
    deadline = began + plan.minutes * 60
    kinds, weights = list(MIX), list(MIX.values())

    async def worker(index: int) -> None:
        rng = random.Random(plan.seed * 1000 + index)
        tenant = list(TENANTS)[index % len(TENANTS)]
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                soak.outcomes.append(await one_request(client, kind, tenant, rng, time.monotonic() - began))

    await asyncio.gather(*(worker(i) for i in range(plan.workers)))


# ---- watching ------------------------------------------------------------------------------------------
def replica_gauges(metrics_text: str) -> tuple[float, int]:
    """Mean KV usage and total running requests over the replicas, from /metrics."""
    usage = [float(v) for v in re.findall(r'^kvloom:kv_cache_usage_perc\{[^}]*\} (\S+)$', metrics_text, re.M)]
    running = [float(v) for v in re.findall(r'^kvloom:num_requests_running\{[^}]*\} (\S+)$', metrics_text, re.M)]
    return (sum(usage) / len(usage) if usage else 0.0), int(sum(running))


def sample(base: str, pid: int, t: float) -> Sample:
    kv, running = replica_gauges(httpx.get(f"{base}/metrics", timeout=10).text)
    return Sample(t, tree_rss_mb(pid), kv, running)


def watch(base: str, pid: int, plan: SoakPlan, soak: Soak, began: float, stop: threading.Event) -> None:
    while not stop.wait(plan.sample_s):
        try:
            soak.samples.append(sample(base, pid, time.monotonic() - began))
        except httpx.HTTPError:
            pass  # a missed sample is a gap in the plot, not a failed soak


def settle(base: str, timeout_s: float = 30.0) -> float:
    """KV usage once the load is gone (the replicas push stats twice a second): it must reach 0."""
    def gauges() -> tuple[float, int]:
        return replica_gauges(httpx.get(f"{base}/metrics", timeout=10).text)

    wait_for(lambda: gauges() == (0.0, 0), timeout_s, period_s=1.0)
    return gauges()[0]


def tenant_usage(base: str) -> dict[str, int]:
    data = httpx.get(f"{base}/v1/usage", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["data"]
    return {row["tenant"]: row["completion_tokens"] for row in data}


# ---- analysis (pure) -----------------------------------------------------------------------------------
def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def windows(outcomes: list[Outcome], plan: SoakPlan) -> list[dict]:
    """p99 TTFT and end-to-end latency of the streamed chats that ended whole, per window after the warm-up."""
    rows = []
    start = plan.warmup_minutes * 60
    while start < plan.minutes * 60:
        end = start + plan.window_minutes * 60
        chosen = [o for o in outcomes if o.kind == "stream" and o.ok and start <= o.start < end]
        rows.append({"from_s": start, "to_s": end, "requests": len(chosen),
                     "ttft_p99": p99([o.ttft for o in chosen if o.ttft is not None]),
                     "e2e_p99": p99([o.e2e for o in chosen])})
        start = end
    return rows


def rss_after_warmup(samples: list[Sample], plan: SoakPlan) -> dict:
    after = [s for s in samples if s.t >= plan.warmup_minutes * 60]
    if not after:
        return {}
    first, last = after[0].rss_mb, after[-1].rss_mb
    return {"at_warmup_mb": first, "at_end_mb": last, "max_mb": max(s.rss_mb for s in after),
            "growth": (last - first) / first}


def summarize(soak: Soak, plan: SoakPlan, usage: dict[str, int], kv_after: float) -> dict:
    outcomes = soak.outcomes
    lost = [o for o in outcomes if not o.ok]
    per_window = windows(outcomes, plan)
    measured = [w for w in per_window if w["ttft_p99"] is not None]
    drift = {key: measured[-1][key] / measured[0][key] for key in ("ttft_p99", "e2e_p99")} if len(measured) > 1 else {}
    received = {t: sum(o.completion_tokens for o in outcomes if o.tenant == t and o.ok) for t in TENANTS}
    rss = rss_after_warmup(soak.samples, plan)
    return {
        "requests": len(outcomes), "by_kind": {k: sum(o.kind == k for o in outcomes) for k in MIX},
        "lost": len(lost), "lost_examples": [asdict(o) for o in lost[:10]],
        "windows": per_window, "drift": drift, "rss": rss, "kv_after": kv_after,
        "kv_mean": float(np.mean([s.kv_usage for s in soak.samples])) if soak.samples else None,
        "usage": usage, "received": received,
        "verdicts": {
            "no request lost": not lost,
            "KV back to 0 after the load": kv_after == 0,
            f"RSS moved at most {RSS_GROWTH_LIMIT:.0%} after the warm-up": bool(rss) and abs(rss["growth"]) <= RSS_GROWTH_LIMIT,
            f"p99 TTFT and e2e drift at most {DRIFT_LIMIT}x": bool(drift) and max(drift.values()) <= DRIFT_LIMIT,
            "each tenant's usage covers what its clients received": all(usage.get(t, 0) >= n for t, n in received.items()),
        },
    }


# ---- report --------------------------------------------------------------------------------------------
def plot(soak: Soak, summary: dict, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    minutes = [s.t / 60 for s in soak.samples]
    axes[0].plot(minutes, [s.rss_mb for s in soak.samples])
    axes[0].set_ylabel("process tree RSS (MB)")
    axes[1].plot(minutes, [100 * s.kv_usage for s in soak.samples], label="KV blocks in use (%)")
    axes[1].plot(minutes, [s.running for s in soak.samples], label="running requests")
    axes[1].legend(loc="upper right")
    measured = [w for w in summary["windows"] if w["ttft_p99"] is not None]
    middles = [(w["from_s"] + w["to_s"]) / 120 for w in measured]
    axes[2].plot(middles, [1000 * w["ttft_p99"] for w in measured], "o-", label="TTFT p99")
    axes[2].plot(middles, [1000 * w["e2e_p99"] for w in measured], "s-", label="end-to-end p99")
    axes[2].set_ylabel("ms (streamed chats)")
    axes[2].set_xlabel("minutes")
    axes[2].legend(loc="upper right")
    for ax in axes:
        ax.axvline(summary["plan"]["warmup_minutes"], color="grey", linestyle=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(doc: dict, soak: Soak, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps({**doc, "samples": [asdict(s) for s in soak.samples]}, indent=1))
    s = doc["summary"]
    plot(soak, s, out_dir / "soak.png")
    plan = s["plan"]
    rss = s["rss"]
    lines = ["# Soak: `kvloom serve` under mixed traffic from two tenants", "", environment_lines(doc["environment"]), "",
             f"{plan['minutes']:.0f} minutes, {plan['workers']} client loops (one request at a time each, seed "
             f"{plan['seed']}), mix {', '.join(f'{k} {v:.0%}' for k, v in MIX.items())}; warm-up "
             f"{plan['warmup_minutes']:.0f} minutes; samples every {plan['sample_s']:.0f} s. "
             f"Regenerate: `python -m kvloom.benchmarks.studies.soak`.", "",
             "| goal | measured | met |", "|---|---|---|"]
    measured = {
        "no request lost": f"{s['lost']} of {s['requests']} ({', '.join(f'{k} {v}' for k, v in s['by_kind'].items())})",
        "KV back to 0 after the load": f"{s['kv_after']:.3f} (mean {s['kv_mean'] or 0:.2f} during)",
        "each tenant's usage covers what its clients received":
            ", ".join(f"{t}: {s['usage'].get(t, 0)} >= {n}" for t, n in s["received"].items()),
    }
    for goal, met in s["verdicts"].items():
        if goal.startswith("RSS"):
            value = (f"{rss['at_warmup_mb']:.0f} -> {rss['at_end_mb']:.0f} MB ({rss['growth']:+.1%}), max "
                     f"{rss['max_mb']:.0f}") if rss else "no samples"
        elif goal.startswith("p99"):
            value = ", ".join(f"{k} {v:.2f}x" for k, v in s["drift"].items()) or "too few windows"
        else:
            value = measured[goal]
        lines.append(f"| {goal} | {value} | {'yes' if met else '**no**'} |")
    lines += ["", "| window (min) | streamed chats | TTFT p99 (ms) | e2e p99 (ms) |", "|---|---|---|---|"]
    for w in s["windows"]:
        lines.append(f"| {w['from_s'] / 60:.0f}-{w['to_s'] / 60:.0f} | {w['requests']} | "
                     + " | ".join(f"{1000 * w[k]:.0f}" if w[k] is not None else "–" for k in ("ttft_p99", "e2e_p99"))
                     + " |")
    if s["lost_examples"]:
        lines += ["", "Lost (first 10):", ""] + [f"- {json.dumps(o)}" for o in s["lost_examples"]]
    lines += ["", "![soak](soak.png)"]
    path = out_dir / "soak.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.studies.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=SoakPlan.minutes)
    parser.add_argument("--warmup-minutes", type=float, default=SoakPlan.warmup_minutes)
    parser.add_argument("--window-minutes", type=float, default=SoakPlan.window_minutes)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    plan = SoakPlan(args.minutes, args.warmup_minutes, args.window_minutes)
    settings = BenchSettings(max_num_seqs=32, kv_cache_memory_bytes=1 << 30)
    spec = SystemSpec("kvloom serve", "kvloom-serve", serve={
        "admin_keys": [ADMIN], "tenants": [{"name": t, "api_keys": [k]} for t, k in TENANTS.items()]})
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    soak = Soak()
    with running_server(spec, settings, 1024, RUNS_DIR / "server.txt") as server:
        began, stop = time.monotonic(), threading.Event()
        watcher = threading.Thread(target=watch, args=(server.base, server.process.pid, plan, soak, began, stop))
        watcher.start()
        try:
            asyncio.run(traffic(server.base, plan, soak, began))
        finally:
            stop.set()
            watcher.join()
        kv_after = settle(server.base)
        usage = tenant_usage(server.base)
    summary = {"plan": asdict(plan), **summarize(soak, plan, usage, kv_after)}
    doc = {"environment": environment(settings), "summary": summary}
    print(f"report: {write_report(doc, soak, args.out)}")
    return 0 if all(summary["verdicts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
