"""Scenarios (b) and (c) of the KV tiers benchmark (benchmarks/kv_tiers.py runs them), over HTTP on a local Ray + Serve
(benchmarks/local_serve.py), each with tiers off, a host tier (in /dev/shm, which every replica of the node maps)
and host + disk:

(b) Two replicas behind the router. One, the holder, computes a few long system prompts (the shared prefixes)
    while the other runs `router.imbalance_threshold` + 1 long streams; then the holder runs as many, so that
    requests on its prefixes overflow to the other replica: the overflow replica's TTFT on them against the
    holder's (a hit in its pool). Either is measured while the other replica decodes the same streams.
(c) One replica runs scenario (a)'s conversations; kvloom's autoscaling adds a second when they back up
    (`--upscale-delay-s` after the backlog starts): the joining replica's TTFT on the conversations it takes
    against the first replica's from then on. A turn's history holds its question and, as the answer, a scripted
    passage of (a)'s answer length (the API returns text; every setup sends the same prompts).

Every replica asks Ray for one CPU and runs one torch thread; the router's queue is FCFS, with no slack beyond
max_num_seqs; each replica's KV pool holds the scenario's whole working set, so the holder and the first replica hit
their pools, and what differs is where the other replica finds a prefix: computed, or loaded from the node's tier.
TTFT is the client's: from sending a streaming /v1/completions request (token ids as its prompt) to its first event.
The replica that served a request comes from the router's `kvloom:requests_total{tenant, replica}` counters: the
requests in flight together each have a tenant of their own, all of one prefix-cache group (they share prefixes as
one tenant's requests do), and the counters before and after a request or a wave name its replica.
"""

import argparse
import asyncio
import json
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import torch

from kvloom.benchmarks.kv_tiers_workload import (ANSWER_TOKENS, QUESTION_TOKENS, Chat, Prose, emptied,
                                                 tier_setups)
from kvloom.benchmarks.local_serve import local_serve
from kvloom.cluster.config import ClusterConfig
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.resources import resolve_dtype

APP = "kv-tiers"
SERVED = "kv-tiers"
GROUP = "chat"  # every tenant's prefix-cache group
PROBE_TOKENS = 2
BUSY_TAIL = 16  # tokens that set the busy streams' prompts apart
STATS_S = 1.0  # replicas report their stats twice a second: a wait for the last report
LABEL = re.compile(r'(\w+)="([^"]*)"')
GOAL = 1.5


def kv_bytes_per_token(model: str) -> int:
    """One token's K and V in every layer, at the engine's dtype auto on this host."""
    dtype = resolve_dtype("auto", torch.device("cpu"))
    return ModelConfig.from_dir(resolve_model_dir(model)).kv_bytes_per_token(dtype)


def cluster_config(model: str, tiers: dict | None, pool_bytes: int, max_model_len: int, args: argparse.Namespace,
                   tenants: list[str], scaling: dict) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "served_model_name": SERVED,
        "engine": {"model": model, "kv_cache_memory_bytes": pool_bytes, "max_model_len": max_model_len,
                   "max_num_seqs": args.max_num_seqs, **({"kv_tiers": tiers} if tiers else {})},
        "router": {"imbalance_threshold": args.imbalance_threshold, "replica_slack": 0, "policy": "fcfs"},
        "resources": {"num_cpus": 1, "torch_threads": 1},
        "tenants": [{"name": t, "api_keys": [f"sk-{t}"], "prefix_cache_group": GROUP} for t in tenants],
        **scaling,
    })


def each_setup(args: argparse.Namespace, tier_bytes: int, run_one: Callable[[dict | None], dict]) -> dict:
    """`run_one(kv_tiers)` for each wanted setup, its tiers empty at the start, its application deleted after."""
    from ray import serve

    results = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as host, tempfile.TemporaryDirectory() as disk:
        for name, tiers in tier_setups(host, disk, tier_bytes).items():
            if name in args.setups:
                emptied(host, disk)
                try:
                    results[name] = run_one(tiers)
                finally:
                    serve.delete(APP)
                print(f"[kv-tiers] {name}: {json.dumps(results[name].get('summary'))}", flush=True)
    return results


# ---- the client ---------------------------------------------------------------------------------------------------
async def first_token_s(client: httpx.AsyncClient, tenant: str, prompt: list[int], max_tokens: int,
                        started: asyncio.Event | None = None) -> float:
    """The TTFT of a streaming completion of `prompt`, read to its end; `started` is set at its first token."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent, ttft = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer sk-{tenant}"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if "error" in (event := json.loads(line[6:])):
                raise RuntimeError(f"stream error: {event['error']}")
            if ttft is None:
                ttft = time.perf_counter() - sent
                if started is not None:
                    started.set()
    return ttft


def finished_requests(metrics: str) -> Counter:
    """Finished requests per (tenant, replica) in the router's /metrics text (`kvloom:requests_total`)."""
    counts = Counter()
    for line in metrics.splitlines():
        if line.startswith("kvloom:requests_total{"):
            labels = dict(LABEL.findall(line))
            counts[labels["tenant"], labels["replica"]] += float(line.rsplit(" ", 1)[1])
    return counts


async def finished_by(client: httpx.AsyncClient) -> Counter:
    return finished_requests((await client.get("/metrics")).text)


def served_by(before: Counter, after: Counter, tenant: str) -> str:
    """The replica where the tenant's one request between the two readings finished."""
    replicas = [replica for (t, replica), n in after.items() if t == tenant and n > before[t, replica]]
    if len(replicas) != 1:
        raise RuntimeError(f"tenant {tenant}: finished on {replicas or 'no replica'}, not on one")
    return replicas[0]


async def replica_stats(router) -> dict[str, dict]:
    return {s["replica_id"]: s for s in await router.replica_stats.remote()}


async def until(router, check: Callable[[dict[str, dict]], bool], what: str, within_s: float = 120.0) -> dict:
    """The router's replica stats once `check` holds for them."""
    deadline = time.monotonic() + within_s
    while not check(stats := await replica_stats(router)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {within_s:.0f} s "
                               f"(in flight: { {r: s['inflight'] for r, s in stats.items()} })")
        await asyncio.sleep(0.05)
    return stats


def tier_counters(stats: dict) -> dict[str, int]:
    """A replica's prefix-cache hits (tokens) and its tiers' hits (blocks)."""
    tiers = stats["kv_tiers"] or {}
    return {"prefix_cache_hits": stats["prefix_cache_hits"],
            **{f"{tier}_hits": tiers[tier]["hits"] for tier in ("host", "disk") if tier in tiers}}


def p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


# ---- (b) overflow ---------------------------------------------------------------------------------------------------
@dataclass
class Busy:
    """Long streams keeping one replica busy, cancelled when done with."""

    tasks: list[asyncio.Task]
    replica: str = ""  # where the router put them all

    def check(self) -> None:
        for task in self.tasks:
            if task.done():
                raise RuntimeError(f"a busy stream ended before the probes did ({task.exception() or 'finished'}): "
                                   "raise --busy-tokens")

    async def stop(self, router) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await until(router, lambda s: all(r["inflight"] == 0 for r in s.values()), "the busy streams cancelled")


async def keep_busy(client: httpx.AsyncClient, router, prompts: list[list[int]], max_tokens: int) -> Busy:
    """The streams, once each has its first token (its prefill done) and the router has them all on one replica."""
    events = [asyncio.Event() for _ in prompts]
    busy = Busy([asyncio.create_task(first_token_s(client, "busy", prompt, max_tokens, event))
                 for prompt, event in zip(prompts, events)])
    while not all(event.is_set() for event in events):
        busy.check()
        await asyncio.sleep(0.05)
    stats = await until(router, lambda s: any(r["inflight"] == len(prompts) for r in s.values()),
                        "the busy streams on one replica")
    busy.replica = next(r for r, s in stats.items() if s["inflight"] == len(prompts))
    return busy


async def probe(client: httpx.AsyncClient, router, busy: Busy, phase: str, prefix: int, prompt: list[int]) -> dict:
    """One request on its own: its TTFT and replica, once the router has its credit back and the busy streams run."""
    before = await finished_by(client)
    ttft = await first_token_s(client, "probe", prompt, PROBE_TOKENS)
    replica = served_by(before, await finished_by(client), "probe")
    busy.check()
    await until(router, lambda s: sum(r["inflight"] for r in s.values()) == len(busy.tasks), "the probe's credit back")
    return {"phase": phase, "prefix": prefix, "replica": replica, "ttft_s": ttft}


async def overflow_run(base: str, router, encode, args: argparse.Namespace) -> dict:
    prose = Prose(encode, seed=1)  # the same prefixes, questions and busy prompts in every setup
    prefixes = [prose.passage(args.system_tokens) for _ in range(args.prefixes)]
    streams = args.imbalance_threshold + 1  # one more than the load gap that overrides prefix affinity
    async with httpx.AsyncClient(base_url=base, timeout=None) as client:
        filler = prose.passage(4 * BUSY_TAIL)
        busy = await keep_busy(client, router, [filler + prose.passage(BUSY_TAIL) for _ in range(streams)],
                               args.busy_tokens)
        holder, other = next(r for r in await replica_stats(router) if r != busy.replica), busy.replica
        probes = [await probe(client, router, busy, phase, k, prefix + prose.passage(QUESTION_TOKENS))
                  for phase in ("computed", "holder") for k, prefix in enumerate(prefixes)]
        await busy.stop(router)
        await asyncio.sleep(STATS_S)
        before = tier_counters((await replica_stats(router))[other])
        busy = await keep_busy(client, router, [prefixes[0] + prose.passage(BUSY_TAIL) for _ in range(streams)],
                               args.busy_tokens)
        if busy.replica != holder:
            raise RuntimeError("the streams on the holder's prefix went to the other replica")
        probes += [await probe(client, router, busy, "overflow", k, prefix + prose.passage(QUESTION_TOKENS))
                   for k, prefix in enumerate(prefixes)]
        await busy.stop(router)
    await asyncio.sleep(STATS_S)
    after = tier_counters((await replica_stats(router))[other])
    return {"holder": holder, "overflow": other, "probes": probes,
            "overflow_counters": {k: after[k] - before.get(k, 0) for k in after}}


def summary_b(run: dict) -> dict:
    def ttft(phase: str, replica: str) -> list[float]:
        return [x["ttft_s"] for x in run["probes"] if x["phase"] == phase and x["replica"] == replica]

    computed, holder = ttft("computed", run["holder"]), ttft("holder", run["holder"])
    overflow = ttft("overflow", run["overflow"])
    p50 = {"computed": p(computed, 50), "holder": p(holder, 50), "overflow": p(overflow, 50)}
    return {**{f"{k}_p50_s": v for k, v in p50.items()},
            "overflow_over_holder": p50["overflow"] / p50["holder"] if holder and overflow else None,
            "misrouted": len(run["probes"]) - len(computed) - len(holder) - len(overflow)}


def scenario_b(base: str, args: argparse.Namespace, model: str, encode) -> dict:
    from kvloom.cluster import app

    max_model_len = args.system_tokens + QUESTION_TOKENS + args.busy_tokens + 16
    probes = args.prefixes * (args.system_tokens + 3 * QUESTION_TOKENS)
    pool_tokens = probes + (args.imbalance_threshold + 1) * max_model_len
    pool_bytes = pool_tokens * kv_bytes_per_token(model)

    def one(tiers: dict | None) -> dict:
        config = cluster_config(model, tiers, pool_bytes, max_model_len, args, ["busy", "probe"], {"num_replicas": 2})
        run = asyncio.run(overflow_run(base, app.deploy(config, APP), encode, args))
        return run | {"summary": summary_b(run)}

    return {"pool_bytes": pool_bytes, "results": each_setup(args, 2 * pool_bytes, one)}


def section_b(b: dict, args: argparse.Namespace) -> list[str]:
    streams = args.imbalance_threshold + 1
    lines = ["## (b) Overflow: the prefix holder busy, requests on its prefixes go to the other replica", "",
             f"Two replicas, {args.prefixes} shared prefixes of {args.system_tokens} tokens (system prompts), each "
             f"request a prefix and a {QUESTION_TOKENS}-token question, {PROBE_TOKENS} tokens generated, one request "
             f"at a time. `router.imbalance_threshold` {args.imbalance_threshold}: {streams} streams of up to "
             f"{args.busy_tokens} tokens keep a replica busy. First the other replica runs them while the holder "
             "computes each prefix, then hits it in its pool; then the holder runs them (on its first prefix) and "
             "the same prefixes overflow to the other replica. KV pool per replica "
             f"{b['pool_bytes'] >> 20} MiB (everything fits). TTFT p50 in seconds:", "",
             "| setup | holder, computing the prefix | holder, pool hit | overflow replica | overflow / holder "
             "(goal 1.5x) | overflow replica: prompt tokens found cached / blocks read from the tier | misrouted |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, run in b["results"].items():
        s, counters = run["summary"], run["overflow_counters"]
        ratio = s["overflow_over_holder"]
        tiers = " / ".join(f"{counters[k]} ({k.removesuffix('_hits')})" for k in ("host_hits", "disk_hits")
                           if k in counters) or "-"
        lines.append(f"| {name} | {seconds(s['computed_p50_s'])} | {seconds(s['holder_p50_s'])} | "
                     f"{seconds(s['overflow_p50_s'])} | {'–' if ratio is None else f'{ratio:.2f}x'}"
                     f"{'' if ratio is None or ratio <= GOAL else ' (**over**)'} | {counters['prefix_cache_hits']} / "
                     f"{tiers} | {s['misrouted']} |")
    return lines + ["", "Misrouted: requests that did not land where the scenario sends them (left out of the "
                    "figures).", ""]


# ---- (c) a replica that joins ---------------------------------------------------------------------------------------
async def joining_run(base: str, router, chat: Chat, answers: list[list[list[int]]], batch: int) -> dict:
    (first,) = await replica_stats(router)
    records, histories = [], [[] for _ in chat.questions]
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=None) as client:
        for turn in range(chat.turns):
            for lo in range(0, len(chat.questions), batch):
                wave, wave_start = range(lo, min(lo + batch, len(chat.questions))), time.monotonic() - started
                before = await finished_by(client)
                ttfts = await asyncio.gather(*(
                    first_token_s(client, f"c{c}", chat.system + histories[c] + chat.questions[c][turn], ANSWER_TOKENS)
                    for c in wave))
                after = await finished_by(client)
                for c, ttft in zip(wave, ttfts):
                    records.append({"turn": turn, "wave_start_s": wave_start, "conversation": c, "ttft_s": ttft,
                                    "replica": served_by(before, after, f"c{c}")})
                    histories[c] += chat.questions[c][turn] + answers[c][turn]
    await asyncio.sleep(STATS_S)
    return {"first": first, "records": records,
            "counters": {r: tier_counters(s) for r, s in (await replica_stats(router)).items()}}


def summary_c(run: dict) -> dict:
    first, records = run["first"], run["records"]
    joined = next((r for r in records if r["replica"] != first), None)
    if joined is None:
        return {"joined": None}
    since = [r for r in records if r["wave_start_s"] >= joined["wave_start_s"]]

    def ttft(replica: str, wave: bool = False) -> list[float]:
        return [r["ttft_s"] for r in since if r["replica"] == replica
                and (not wave or r["wave_start_s"] == joined["wave_start_s"])]

    stays, joins = ttft(first), ttft(joined["replica"])
    return {"joined": joined["replica"], "joined_turn": joined["turn"], "joined_after_s": joined["wave_start_s"],
            "first_requests": len(stays), "first_p50_s": p(stays, 50), "first_p90_s": p(stays, 90),
            "joining_requests": len(joins), "joining_p50_s": p(joins, 50), "joining_p90_s": p(joins, 90),
            "joining_first_wave_p50_s": p(ttft(joined["replica"], wave=True), 50),
            "joining_over_first": p(joins, 50) / p(stays, 50) if stays else None}


def scenario_c(base: str, args: argparse.Namespace, model: str, encode, chat: Chat) -> dict:
    from kvloom.cluster import app

    turn_tokens = QUESTION_TOKENS + ANSWER_TOKENS
    max_model_len = len(chat.system) + chat.turns * turn_tokens + 16
    working_set = len(chat.system) + len(chat.questions) * chat.turns * turn_tokens
    pool_bytes = int(1.1 * working_set) * kv_bytes_per_token(model)
    prose = Prose(encode, seed=2)
    answers = [[prose.passage(ANSWER_TOKENS) for _ in range(chat.turns)] for _ in chat.questions]
    scaling = {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "target": {"waiting_per_replica": 1},
                               "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": 3600}}
    tenants = [f"c{c}" for c in range(len(chat.questions))]

    def one(tiers: dict | None) -> dict:
        config = cluster_config(model, tiers, pool_bytes, max_model_len, args, tenants, scaling)
        run = asyncio.run(joining_run(base, app.deploy(config, APP), chat, answers, args.batch))
        return run | {"summary": summary_c(run)}

    return {"pool_bytes": pool_bytes, "working_set_tokens": working_set,
            "results": each_setup(args, int(2 * working_set * kv_bytes_per_token(model)), one)}


def section_c(c: dict, args: argparse.Namespace) -> list[str]:
    lines = ["## (c) A replica that joins while the conversations run", "",
             f"Scenario (a)'s {args.conversations} conversations of {args.turns} turns over HTTP, {args.batch} "
             f"requests sent together, each replica {args.max_num_seqs} at once; one replica at the start, "
             f"autoscaling to two (`waiting_per_replica` 1, upscale delay {args.upscale_delay_s:g} s). KV pool per "
             f"replica {c['pool_bytes'] >> 20} MiB (the working set of {c['working_set_tokens']} tokens fits). TTFT "
             "in seconds, from the wave where the joining replica took its first request on:", "",
             "| setup | joined at turn (s into the run) | first replica p50 / p90 (requests) | joining replica p50 / "
             "p90 (requests) | its first wave p50 | joining / first (p50, goal 1.5x) | joining replica: prompt "
             "tokens found cached / blocks read from the tier |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, run in c["results"].items():
        s = run["summary"]
        if s["joined"] is None:
            lines.append(f"| {name} | no replica joined during the run | | | | | |")
            continue
        counters = run["counters"].get(s["joined"], {})
        tiers = " / ".join(f"{counters[k]} ({k.removesuffix('_hits')})" for k in ("host_hits", "disk_hits")
                           if k in counters) or "-"
        ratio = s["joining_over_first"]
        lines.append(f"| {name} | {s['joined_turn']} ({s['joined_after_s']:.0f}) | {seconds(s['first_p50_s'])} / "
                     f"{seconds(s['first_p90_s'])} ({s['first_requests']}) | {seconds(s['joining_p50_s'])} / "
                     f"{seconds(s['joining_p90_s'])} ({s['joining_requests']}) | "
                     f"{seconds(s['joining_first_wave_p50_s'])} | {'–' if ratio is None else f'{ratio:.2f}x'}"
                     f"{'' if ratio is None or ratio <= GOAL else ' (**over**)'} | "
                     f"{counters.get('prefix_cache_hits', '–')} / {tiers} |")
    return lines + ["", "No vLLM rows in (b) and (c): they need a prefix-aware router in front of several vLLM engines "
                    "(Ray Serve LLM, llm-d), which this benchmark does not set up.", ""]


# ---- both -----------------------------------------------------------------------------------------------------------
def run_scenarios(args: argparse.Namespace, model: str, encode, chat: Chat) -> dict:
    """(b) and (c), as `args.scenarios` asks, on one local Ray + Serve."""
    done = {}
    with local_serve(num_cpus=4) as base:
        if "b" in args.scenarios:
            done["b"] = scenario_b(base, args, model, encode)
        if "c" in args.scenarios:
            done["c"] = scenario_c(base, args, model, encode, chat)
    return done


def sections(served: dict, args: argparse.Namespace) -> list[str]:
    return ((section_b(served["b"], args) if "b" in served else [])
            + (section_c(served["c"], args) if "c" in served else []))
