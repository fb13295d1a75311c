"""Scaling: a load ramp against kvloom's autoscaling and against fixed minimum and maximum replica counts.

The ramp: idle, a burst of 48 streams at once, a plateau (48 streams kept in flight: each one that ends is
replaced), then idle again for the downscale delay plus 30 s; every run spans the same ramp. Sampled every
second: the replicas Serve runs and starts. Per run: replicas over time, TTFT p50/p99 per phase, requests lost
(anything but a whole stream), replica-seconds, how long the scale-up decision took after the burst (and the
new replica to serve), how long idle replicas stayed after the load ended.

The model is the tiny random one and CPUs are logical (each replica asks Ray for one and uses one thread): on
a 2-core host more replicas add no compute, so the run shows the decisions and the losses honestly, not a
speed-up; TTFT moves with how many streams wait for a slot (each replica has MAX_NUM_SEQS).

    python -m kvloom.benchmarks.scaling        (about 9 minutes; writes benchmarks/results/scaling.{md,json,png})
"""

import argparse
import asyncio
import json
import platform
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.local_serve import local_serve
from kvloom.benchmarks.report import pyplot
from kvloom.benchmarks.tiny_model import build_tiny_llama
from kvloom.kernels.host_isa import host_isa

RESULTS_DIR = Path(__file__).parent / "results"
STREAMS = 48
MAX_NUM_SEQS = 16
MAX_TOKENS = 200
AUTOSCALING = {"min_replicas": 1, "max_replicas": 3, "target": {"waiting_per_replica": 4}, "upscale_delay_s": 2,
               "downscale_delay_s": 15, "graceful_period_s": 5}
RUNS = {"autoscaling": {"autoscaling": AUTOSCALING}, "fixed minimum": {"num_replicas": 1},
        "fixed maximum": {"num_replicas": 3}}


@dataclass(frozen=True)
class Ramp:
    idle_s: float = 10.0
    plateau_s: float = 60.0  # from the burst on
    cooldown_s: float = AUTOSCALING["downscale_delay_s"] + 30  # the final idle phase, the same for every run


@dataclass
class Stream:
    phase: str  # burst (the first 48) or plateau (their replacements)
    start: float
    ttft: float | None = None
    end: float | None = None
    ok: bool = False
    error: str | None = None


@dataclass
class Run:
    name: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, running, starting)
    streams: list[Stream] = field(default_factory=list)
    burst_at: float = 0.0
    load_end: float = 0.0
    wall_t0: float = 0.0  # time.time() at t0: scaling events carry wall-clock times
    cold_starts: list[dict] = field(default_factory=list)  # replicas that joined after the burst (cold_starts())


def cluster_config(model_dir: Path, scaling: dict):
    from kvloom.cluster.config import ClusterConfig

    return ClusterConfig.model_validate({
        "served_model_name": "tiny",
        "engine": {"model": str(model_dir), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                   "max_model_len": 1024, "max_num_seqs": MAX_NUM_SEQS},
        "router": {"replica_slack": 0},
        "resources": {"num_cpus": 1, "torch_threads": 1},
        **scaling,
    })


def replica_counts() -> tuple[int, int]:
    from ray import serve

    states = serve.status().applications["kvloom"].deployments["EngineReplica"].replica_states
    return states.get("RUNNING", 0), states.get("STARTING", 0)


def watch(run: Run, t0: float, stop: threading.Event) -> None:
    while not stop.is_set():
        run.samples.append((time.monotonic() - t0, *replica_counts()))
        stop.wait(1.0)


async def one_stream(client: httpx.AsyncClient, phase: str, t0: float) -> Stream:
    stream = Stream(phase, time.monotonic() - t0)
    body = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}"
                return stream
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    stream.error = event["error"].get("message", "error")
                    continue
                if stream.ttft is None:
                    stream.ttft = time.monotonic() - t0 - stream.start
        stream.ok = stream.error is None
    except httpx.HTTPError as exc:
        stream.error = repr(exc)
    stream.end = time.monotonic() - t0
    return stream


async def load(base: str, run: Run, ramp: Ramp, t0: float) -> None:
    await asyncio.sleep(ramp.idle_s)
    run.burst_at = time.monotonic() - t0
    plateau_end = time.monotonic() + ramp.plateau_s
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def lane() -> None:
            phase = "burst"
            while True:
                run.streams.append(await one_stream(client, phase, t0))
                phase = "plateau"
                if time.monotonic() >= plateau_end:
                    return
        await asyncio.gather(*(lane() for _ in range(STREAMS)))
    run.load_end = time.monotonic() - t0


def one_run(base: str, name: str, model_dir: Path, ramp: Ramp) -> Run:
    from kvloom.cluster import app

    config = cluster_config(model_dir, RUNS[name])
    router = app.deploy(config, "kvloom")
    run, stop, t0 = Run(name, wall_t0=time.time()), threading.Event(), time.monotonic()
    watcher = threading.Thread(target=watch, args=(run, t0, stop), daemon=True)
    watcher.start()
    asyncio.run(load(base, run, ramp, t0))
    run.cold_starts = cold_starts(run, router.replica_stats.remote().result(), router.scaling_events.remote().result())
    time.sleep(ramp.cooldown_s)
    stop.set()
    watcher.join()
    return run


def cold_starts(run: Run, replicas: list[dict], events: list[dict]) -> list[dict]:
    """Each replica that joined after the burst (still there when the load ends): when the router first routed to
    it, seconds after the burst, and its start's phases as it reports them (`kvloom status` shows the same):
    Ray starting its process and the imports, then the engine's own phases."""
    joined_at = {replica: event["time"] - run.wall_t0 - run.burst_at for event in events for replica in event["joined"]}
    return [{"replica": r["replica_id"], "joined_after_burst_s": joined_at[r["replica_id"]], "startup": r["startup"]}
            for r in replicas if joined_at.get(r["replica_id"], -1.0) > 0]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(run: Run) -> dict:
    times = [t for t, _, _ in run.samples]
    running = [r for _, r, _ in run.samples]
    replica_seconds = float(np.trapezoid(running, times)) if len(times) > 1 else 0.0
    floor = running[0] if running else 0
    grew = next((t for t, r, s in run.samples if t >= run.burst_at and r + s > floor), None)
    serving = next((t for t, r, _ in run.samples if t >= run.burst_at and r > floor), None)
    shrunk = next((t for t, r, _ in run.samples if t >= run.load_end and r <= floor), None)
    phases = {}
    for phase in ("burst", "plateau"):
        ttfts = [s.ttft for s in run.streams if s.phase == phase and s.ttft is not None]
        phases[phase] = {"streams": sum(s.phase == phase for s in run.streams),
                         "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}
    lost = [asdict(s) for s in run.streams if not s.ok]
    return {"name": run.name, "streams": len(run.streams), "lost": len(lost), "lost_examples": lost[:5],
            "replica_seconds": replica_seconds, "max_replicas": max(running, default=0),
            "scale_up_decided_after_s": None if grew is None else grew - run.burst_at,
            "new_replica_serving_after_s": None if serving is None else serving - run.burst_at,
            "idle_replicas_gone_after_s": None if shrunk is None else shrunk - run.load_end,
            "phases": phases, "burst_at_s": run.burst_at, "load_end_s": run.load_end, "cold_starts": run.cold_starts}


def plot(runs: list[Run], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in runs:
        axes[0].step([t for t, _, _ in run.samples], [r for _, r, _ in run.samples], where="post", label=run.name)
        done = sorted((s.start + s.ttft, s.ttft) for s in run.streams if s.ttft is not None)
        axes[1].plot([t for t, _ in done], [v for _, v in done], ".", markersize=3, label=run.name)
    axes[0].set_ylabel("replicas running")
    axes[1].set_ylabel("TTFT (s), at first token")
    axes[1].set_xlabel("seconds")
    for ax in axes:
        ax.axvline(runs[0].burst_at, color="grey", linestyle=":")
        ax.axvline(runs[0].load_end, color="grey", linestyle=":")
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdicts(summaries: dict[str, dict]) -> list[tuple[str, str, bool]]:
    auto, most = summaries["autoscaling"], summaries["fixed maximum"]
    up, gone = auto["scale_up_decided_after_s"], auto["idle_replicas_gone_after_s"]
    limit = AUTOSCALING["downscale_delay_s"] + 30
    ttft, ttft_max = auto["phases"]["plateau"]["ttft_p99_s"], most["phases"]["plateau"]["ttft_p99_s"]
    share = auto["replica_seconds"] / most["replica_seconds"] if most["replica_seconds"] else None
    return [
        ("scale-up decided within 10 s of the burst", "never" if up is None else f"{up:.1f} s",
         up is not None and up <= 10),
        (f"idle replicas gone within downscale delay + 30 s ({limit:.0f} s)",
         "never" if gone is None else f"{gone:.1f} s", gone is not None and gone <= limit),
        ("0 requests lost or errored over the ramp", ", ".join(f"{s['name']} {s['lost']}/{s['streams']}"
                                                               for s in summaries.values()),
         all(s["lost"] == 0 for s in summaries.values())),
        ("plateau p99 TTFT within 1.5x of the fixed maximum's", "no samples" if None in (ttft, ttft_max) else
         f"{ttft:.2f} s vs {ttft_max:.2f} s ({ttft / ttft_max:.2f}x)",
         None not in (ttft, ttft_max) and ttft <= 1.5 * ttft_max),
        ("at most 70% of the fixed maximum's replica-seconds", "n/a" if share is None else f"{share:.0%}",
         share is not None and share <= 0.7),
    ]


def write_report(summaries: dict[str, dict], runs: list[Run], ramp: Ramp, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    environment = {"host": platform.node(), "cpu": host_isa().describe(), "commit": source_commit()}
    (out_dir / "scaling.json").write_text(json.dumps(
        {"environment": environment, "ramp": asdict(ramp), "autoscaling": AUTOSCALING, "summaries": summaries,
         "samples": {r.name: r.samples for r in runs}}, indent=1))
    plot(runs, out_dir / "scaling.png")
    lines = ["# Scaling: a load ramp against autoscaling and fixed replica counts", "",
             f"kvloom `{environment['commit']}` on `{environment['host']}` ({environment['cpu']}). Tiny random "
             f"model, each replica one logical CPU and one thread, {MAX_NUM_SEQS} slots, no router slack. Ramp: "
             f"{ramp.idle_s:.0f} s idle, a burst of {STREAMS} streams of {MAX_TOKENS} tokens, kept in flight "
             f"{ramp.plateau_s:.0f} s from the burst on, then {ramp.cooldown_s:.0f} s idle (every run spans the "
             f"same ramp, so replica-seconds compare). Autoscaling: `{json.dumps(AUTOSCALING)}`. On this host "
             "more replicas add no compute (two cores): the runs show decisions and losses, not a speed-up; a "
             "new replica also competes for the cores while it starts, which is why it serves many seconds after "
             "the decision and why one replica alone may finish more streams. Regenerate: "
             "`python -m kvloom.benchmarks.scaling`.", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {goal} | {value} | {'yes' if met else '**no**'} |" for goal, value, met in verdicts(summaries)]
    lines += ["", "| run | streams | lost | max replicas | replica-seconds | burst TTFT p50 / p99 (s) | "
              "plateau TTFT p50 / p99 (s) | scale-up decided / serving after (s) | back at minimum after (s) |",
              "|---|---|---|---|---|---|---|---|---|"]

    def seconds(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    for s in summaries.values():
        burst, plateau = s["phases"]["burst"], s["phases"]["plateau"]
        lines.append(f"| {s['name']} | {s['streams']} | {s['lost']} | {s['max_replicas']} | "
                     f"{s['replica_seconds']:.0f} | {seconds(burst['ttft_p50_s'])} / {seconds(burst['ttft_p99_s'])} | "
                     f"{seconds(plateau['ttft_p50_s'])} / {seconds(plateau['ttft_p99_s'])} | "
                     f"{seconds(s['scale_up_decided_after_s'])} / {seconds(s['new_replica_serving_after_s'])} | "
                     f"{seconds(s['idle_replicas_gone_after_s'])} |")
    starts = summaries["autoscaling"]["cold_starts"]
    if starts:
        phases = list(starts[0]["startup"])
        lines += ["", "### Cold starts (autoscaling run)", "",
                  f"Scale-up decided {seconds(summaries['autoscaling']['scale_up_decided_after_s'])} s after the "
                  "burst (Serve's replica count sampled every second). Per replica that joined: when the router "
                  "first routed to it, and its start as it reports it (`process start`: Ray starting the actor's "
                  "process, Serve's wrapper and the imports; then the engine's phases). On two cores the new "
                  "replica starts beside replicas already decoding at full load.", "",
                  "| replica | joined after burst (s) | " + " | ".join(f"{p} (s)" for p in phases) + " |",
                  "|---|---:|" + "---:|" * len(phases)]
        lines += [f"| {c['replica']} | {c['joined_after_burst_s']:.2f} | "
                  + " | ".join(seconds(c["startup"].get(p)) for p in phases) + " |" for c in starts]
    lines += ["", "![replicas and TTFT over time](scaling.png)"]
    path = out_dir / "scaling.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--plateau-s", type=float, default=Ramp.plateau_s)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    ramp = Ramp(plateau_s=args.plateau_s)
    with tempfile.TemporaryDirectory() as tmp, local_serve(num_cpus=8) as base:
        model_dir = build_tiny_llama(Path(tmp) / "tiny")
        runs = [one_run(base, name, model_dir, ramp) for name in RUNS]
    summaries = {run.name: summarize(run) for run in runs}
    print(write_report(summaries, runs, ramp, args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
