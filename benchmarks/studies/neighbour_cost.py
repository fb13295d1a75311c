"""What CPU taken beside the engine costs it: decode steps with and without neighbours, alternated.

`kvloom serve` runs its HTTP router, Serve's controller and proxy, Ray's daemons and, in the benchmarks, the
client on the cores the engine's threads fill. They take CPU in short bursts (the router's is a step's
worth of streamed tokens at a time). A burst that preempts one of the engine's threads while it holds a
work item holds up the other at the end of that call: every kernel call needs all of its items before the
next can start. So the engine loses more than the neighbours' share of the machine; this measures how much.

The engine decodes `--batch` requests (256-token prompts, prefilled first). Rounds of `--steps` decode steps
alternate between a quiet host and one with synthetic neighbours: processes in Linux's SCHED_BATCH class, as
`kvloom serve` puts Ray's, each sleeping and then spinning for a while, shaped after a served W1 run (one
burst of 10 ms and two of 3-4 ms every 200 ms, four processes waking every 10 ms for 0.1 ms; ~11% of a
core). Alternating rounds, each quiet one next to a noisy one, cancel the host's drift. The report gives
the neighbours' share of the machine (their CPU time over cores x wall time), the share of the engine's
throughput lost, and their ratio, the amplification: 1.0 where the engine gives up just the CPU the
neighbours used, up to the number of threads where every burst stalls all of them.

    python -m kvloom.benchmarks.studies.neighbour_cost [--batch 48] [--rounds 16] [--steps 10]   (~2 minutes)

writes benchmarks/results/neighbour-cost/<host>.md.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvloom.benchmarks.studies.profile_decode import fill
from kvloom.benchmarks.serving_cpu import process_cpu_seconds
from kvloom.engine.llm_engine import LLMEngine
from kvloom.kernels.host_isa import host_isa
from kvloom.kernels.item_pool import intra_op_threads

RESULTS = Path(__file__).resolve().parents[1] / "results" / "neighbour-cost"
# (period s, burst s) per neighbour process: a router's step of streamed tokens, the client's and the
# replica's own share of it, and Ray's periodic wake-ups
NEIGHBOURS = ((0.2, 0.010), (0.2, 0.004), (0.2, 0.003), *[(0.01, 0.0001)] * 4)


# sleep, then spin for the burst, forever, in SCHED_BATCH where Linux has it (a bare interpreter: no imports
# of kvloom or torch to pay for, nor a forked copy of the engine's threads)
NEIGHBOUR = """
import os, sys, time
period, burst = float(sys.argv[1]), float(sys.argv[2])
try:
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
except (AttributeError, OSError):
    pass
while True:
    time.sleep(period)
    end = time.perf_counter() + burst
    while time.perf_counter() < end:
        pass
"""


@dataclass
class Round:
    noisy: bool
    wall_s: float
    step_s: list[float]
    neighbour_cpu_s: float


def run_round(engine: LLMEngine, steps: int, noisy: bool) -> Round:
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(period), str(burst)])
             for period, burst in NEIGHBOURS] if noisy else []
    time.sleep(0.3 if noisy else 0)  # past their start-up
    before = [process_cpu_seconds(p.pid) for p in procs]
    start, times = time.perf_counter(), []
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    wall = time.perf_counter() - start
    used = sum(process_cpu_seconds(p.pid) - b for p, b in zip(procs, before))
    for proc in procs:
        proc.kill()
        proc.wait()
    return Round(noisy, wall, times, used)


def summarize(rounds: list[Round], cores: int) -> dict:
    """Quiet rounds against noisy ones: median step times, the neighbours' share of the machine over the noisy
    rounds, the engine's throughput lost there (pooled, and per noisy round against the quiet one before it)
    and their ratio, the amplification."""
    quiet = [r for r in rounds if not r.noisy]
    noisy = [r for r in rounds if r.noisy]
    share = sum(r.neighbour_cpu_s for r in noisy) / (cores * sum(r.wall_s for r in noisy))
    lost = 1 - sum(r.wall_s for r in quiet) / sum(r.wall_s for r in noisy)
    return {"quiet_step_ms": 1e3 * statistics.median(t for r in quiet for t in r.step_s),
            "noisy_step_ms": 1e3 * statistics.median(t for r in noisy for t in r.step_s),
            "share": share, "lost": lost, "amplification": lost / share if share > 0 else float("nan"),
            "lost_by_pair": [1 - q.wall_s / n.wall_s for q, n in zip(quiet, noisy)]}


def measure(batch: int, rounds: int, steps: int) -> dict:
    engine = LLMEngine(model="smollm2", max_model_len=2048)
    engine.warm_up()
    fill(engine, batch, "n", max_tokens=2 * rounds * steps + 10)
    for _ in range(3):
        engine.step()
    done = [run_round(engine, steps, noisy) for _ in range(rounds) for noisy in (False, True)]
    cores = os.cpu_count() or 1
    return {**summarize(done, cores), "batch": batch, "rounds": rounds, "steps": steps, "cores": cores,
            "threads": intra_op_threads(), "dtype": str(engine.dtype).removeprefix("torch.")}


def report(m: dict) -> str:
    pairs = ", ".join(f"{100 * p:.1f}%" for p in m["lost_by_pair"])
    return "\n".join([
        "# What CPU beside the engine costs it",
        "",
        f"Host: {host_isa().describe()}, {m['cores']} CPUs; SmolLM2 {m['dtype']}, {m['threads']} engine threads, "
        f"{m['batch']} requests decoding (256-token prompts). {m['rounds']} quiet rounds of {m['steps']} decode steps "
        f"alternated with as many beside synthetic neighbours ({len(NEIGHBOURS)} SCHED_BATCH processes shaped after "
        f"a served W1 run). Regenerate: `python -m kvloom.benchmarks.studies.neighbour_cost`.",
        "",
        "| decode step, quiet (median) | beside the neighbours | neighbours' share of the machine | "
        "engine throughput lost | amplification (lost / share) |",
        "|---|---|---|---|---|",
        f"| {m['quiet_step_ms']:.1f} ms | {m['noisy_step_ms']:.1f} ms | {100 * m['share']:.1f}% | "
        f"{100 * m['lost']:.1f}% | {m['amplification']:.2f}x |",
        "",
        f"Lost, each noisy round against the quiet one before it: {pairs} (median "
        f"{100 * statistics.median(m['lost_by_pair']):.1f}%).",
        "",
        "At 1.0x the engine would give up just the CPU its neighbours used; each burst that preempts an engine "
        "thread holding a work item stalls the other at the end of that call, which takes it towards the number "
        "of threads.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = report(measure(args.batch, args.rounds, args.steps))
    out = args.out or RESULTS / f"{host_isa().report_key}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
