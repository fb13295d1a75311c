"""The performance goals, each checked against the numbers of one suite run.

A goal whose inputs are missing (a system that timed out, a section not run) is reported as
"not measured", never as met.
"""

from dataclasses import dataclass

from kvloom.benchmarks.run_results import cpu_efficiency, metric, system_result


@dataclass
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured

    @property
    def verdict(self) -> str:
        return {True: "met", False: "missed", None: "not measured"}[self.met]


def _ratio_goal(name: str, target: str, value: float | None, threshold: float, unit: str = "x",
                detail: str = "") -> Goal:
    if value is None:
        return Goal(name, target, "–", None)
    margin = value / threshold
    how = f"{margin:.2f}x of target" if value >= threshold else f"missed by {(1 - margin):.0%}"
    shown = f"{value:.0f}%" if unit == "%" else f"{value:.2f}{unit}"
    return Goal(name, target, f"{shown} ({how}){detail}", value >= threshold)


def _div(a, b):
    return a / b if a is not None and b else None


def _per_cpu(run: dict, a: str, b: str) -> str:
    """"; per CPU second Nx": the same ratio from output tokens per CPU second, steadier on a shared machine."""
    ra, rb = system_result(run, a), system_result(run, b)
    ratio = ra and rb and ra["metrics"] and rb["metrics"] and _div(cpu_efficiency(ra["metrics"]),
                                                                    cpu_efficiency(rb["metrics"]))
    return f"; per CPU second {ratio:.2f}x" if ratio else ""


def _throughput_goal(w1: dict, system: str, name: str, machine: dict | None) -> Goal:
    peers = [r for r in w1["results"] if r["spec"]["kind"] != "kvloom" and r["metrics"]]
    best = max(peers, key=lambda r: r["metrics"]["output_tok_s"], default=None)
    detail = ""
    if best:
        detail = f"; best peer {best['spec']['name']} {best['metrics']['output_tok_s']:.1f} tok/s"
        if best["spec"]["num_requests"]:
            detail += f" on the first {best['spec']['num_requests']} requests"
        detail += _per_cpu(w1, system, best["spec"]["name"])
    if system != "continuous" and machine and (wall := metric(w1, system, "wall_s")):
        detail += f"; wall {wall / machine['roofline_s']:.2f}x roofline"
    return _ratio_goal(name, f"kvloom {system} output tok/s >= 3x the best peer",
                       _div(metric(w1, system, "output_tok_s"), best and best["metrics"]["output_tok_s"]), 3.0,
                       detail=detail)


def w1_goals(w1: dict, machine: dict | None, kv_cache_memory_bytes: int, threads: int,
             narrow_kv: str | None = None, decode_probe: dict | None = None) -> list[Goal]:
    """`narrow_kv`: a continuous system with a float16 KV cache, held to the throughput goal as well.
    `decode_probe`: a `paired_decode_probe` result; the decode goal is judged on it when given, else on
    the run's own batch-64 steps."""
    goals = [_throughput_goal(w1, "continuous", "W1 throughput vs peers", machine)]
    if narrow_kv and system_result(w1, narrow_kv):
        goals.append(_throughput_goal(w1, narrow_kv, "W1 throughput vs peers, fp16 KV cache", machine))
    if machine:
        wall = metric(w1, "continuous", "wall_s")
        ratio = _div(wall, machine["roofline_s"])
        measured = "–" if ratio is None else f"{ratio:.2f}x roofline ({wall:.0f} s vs {machine['roofline_s']:.0f} s)"
        cpu = metric(w1, "continuous", "cpu_s")
        if ratio is not None and cpu:
            measured += f"; by CPU time / {threads} threads {cpu / threads / machine['roofline_s']:.2f}x"
        goals.append(Goal("W1 vs compute roofline", "W1 wall <= 2x roofline", measured,
                          None if ratio is None else ratio <= 2.0))
        probes = {p["target_batch"]: p for p in machine.get("probes", [])}
        if decode_probe:
            goals.append(_paired_decode_goal(decode_probe, probes.get(64)))
        elif 64 in probes:
            p = probes[64]
            detail = f"; {p['flops_per_s'] / 1e9:.1f} vs {p['gemm_rate'] / 1e9:.1f} GFLOP/s"
            if p.get("cpu_efficiency"):
                detail += f"; by CPU time {p['cpu_efficiency']:.0%}"
            goals.append(_ratio_goal("decode efficiency at batch 64", "decode step >= 60% of GEMM FLOP/s at M=64",
                                     p["efficiency"] * 100, 60.0, unit="%", detail=detail))
        if 32 in probes:
            p = probes[32]
            goals.append(Goal("engine overhead at batch 32", "step time outside runner.execute < 10%",
                              f"{p['overhead']:.1%} ({(p['step_s'] - p['forward_s']) * 1000:.1f} ms of "
                              f"{p['step_s'] * 1000:.0f} ms)", p["overhead"] < 0.10))
        rss = metric(w1, "continuous", "peak_rss_mb")
        loaded = (system_result(w1, "continuous") or {}).get("rss_after_load_mb")
        kv_mb = kv_cache_memory_bytes / 2**20
        limit = machine["weights_mb"] + kv_mb + 500
        after_load = f"; {loaded:.0f} MB already after load (weights and the whole KV pool allocated)" if loaded else ""
        goals.append(Goal("peak RSS on W1", f"<= weights + KV budget + 500 MB ({limit:.0f} MB)",
                          "–" if rss is None else f"{rss:.0f} MB ({rss - limit:+.0f} MB vs limit{after_load})",
                          None if rss is None else rss <= limit))
    return goals


def w1_time_goal(spent_s: float | None, limit_s: float = 15 * 60) -> Goal:
    """Acceptance 1 as measured: W1 with every strategy, both peers and the roofline (process start-ups and
    model loads included) within `limit_s` on the machine that ran it, not stretched for a slower one."""
    name, target = "W1 in one command", f"every strategy, both peers and the roofline within {limit_s / 60:.0f} min"
    if spent_s is None:
        return Goal(name, target, "–", None)
    verdict = "under" if spent_s <= limit_s else "over"
    return Goal(name, target, f"{spent_s / 60:.1f} min ({abs(limit_s - spent_s) / 60:.1f} min {verdict})",
                spent_s <= limit_s)


def _paired_decode_goal(probe: dict, in_run: dict | None) -> Goal:
    detail = (f"; best step {probe['best_step_s'] * 1000:.0f} ms at context {probe['context']}, "
              f"{probe['flops_per_s'] / 1e9:.1f} vs {probe['gemm_rate'] / 1e9:.1f} GFLOP/s (best of each, alternated "
              f"in one process); median vs median {probe['median_efficiency']:.0%}")
    if in_run:
        detail += f"; W1's own batch-64 steps (mean) against the roofline's GEMM rate {in_run['efficiency']:.0%}"
    return _ratio_goal("decode efficiency at batch 64", "decode step >= 60% of GEMM FLOP/s at M=64",
                       probe["efficiency"] * 100, 60.0, unit="%", detail=detail)


def chat_goal(chat_runs: list[dict]) -> Goal:
    top = max(chat_runs, key=lambda run: run["params"]["rate"])
    ratio = _div(metric(top, "continuous", "output_tok_s"), metric(top, "dynamic", "output_tok_s"))
    return _ratio_goal("chat at saturation", "continuous >= 1.2x dynamic output tok/s",
                       ratio, 1.2, detail=f" at {top['params']['rate']} req/s" + _per_cpu(top, "continuous", "dynamic"))


def long_prefill_goal(run: dict) -> Goal:
    unchunked, chunked = metric(run, "continuous", "tpot.p99"), metric(run, "continuous+chunked", "tpot.p99")
    if unchunked is None or chunked is None:
        return Goal("chunked prefill on long-prefill", "lower p99 TPOT than unchunked", "–", None)
    itl_text = ""
    for stat in ("p99", "max"):  # where chunking shows on a CPU: the longest stall, not the mean gap
        gaps = [metric(run, s, f"itl.{stat}") for s in ("continuous+chunked", "continuous")]
        if None not in gaps:
            itl_text += f"; {stat} inter-token gap {gaps[0] * 1000:.0f} vs {gaps[1] * 1000:.0f} ms"
    return Goal("chunked prefill on long-prefill", "lower p99 TPOT than unchunked",
                f"{chunked * 1000:.0f} ms vs {unchunked * 1000:.0f} ms ({chunked / unchunked:.2f}x){itl_text}",
                chunked < unchunked)


def prefix_goal(run: dict, on: str, off: str) -> Goal:
    factor = _div(metric(run, on, "output_tok_s"), metric(run, off, "output_tok_s"))
    hit = metric(run, on, "prefix_hit_rate")
    return Goal("prefix caching on shared-prefix", "raises tok/s (report the factor)",
                "–" if factor is None else f"{factor:.2f}x tok/s{_per_cpu(run, on, off)}, hit rate {hit:.0%}",
                None if factor is None else factor > 1.0)


def goals_table(goals: list[Goal]) -> str:
    rows = ["| goal | target | measured | verdict |", "|---|---|---|---|"]
    rows += [f"| {g.name} | {g.target} | {g.measured} | **{g.verdict}** |" for g in goals]
    return "\n".join(rows)


def _best(run: dict, kinds: tuple[str, ...]) -> dict | None:
    done = [r for r in run["results"] if r["spec"]["kind"] in kinds and r["metrics"]]
    return max(done, key=lambda r: r["metrics"]["output_tok_s"], default=None)


def _versus(name: str, target: str, ours: dict | None, theirs: dict | None, threshold: float) -> Goal:
    if not ours or not theirs:
        return Goal(name, target, "–", None)
    a, b = ours["metrics"]["output_tok_s"], theirs["metrics"]["output_tok_s"]
    detail = f": {ours['spec']['name']} {a:.1f} vs {theirs['spec']['name']} {b:.1f} out tok/s"
    return _ratio_goal(name, target, a / b, threshold, detail=detail)


def peer_goals(run: dict) -> list[Goal]:
    """Issue 17's goals on one W1 run with the external peers: kvloom against vLLM's CPU build (offline, both
    dtypes, and over HTTP), llama.cpp's server, the serving path against kvloom's own offline engine, peak
    RSS of whole process trees, and float32 greedy agreement with vLLM."""
    named = lambda name: system_result(run, name) if metric(run, name, "output_tok_s") else None  # noqa: E731
    offline = _best(run, ("kvloom",))
    goals = [
        _versus("W1 offline, best setting each", "kvloom >= 1.5x vLLM", offline, _best(run, ("vllm",)), 1.5),
        _versus("W1 offline, float32 each", "kvloom >= 1.5x vLLM", named("continuous-fp32"),
                named("vllm-fp32"), 1.5),
        _versus("W1 over HTTP, default dtype each (vLLM float32 on CPUs without bf16)",
                "kvloom serve >= 1.5x vllm serve", named("kvloom-serve"),
                _best(run, ("vllm-serve",)), 1.5),
        _versus("serving at offline speed", "kvloom serve >= 0.9x kvloom offline", named("kvloom-serve"),
                offline, 0.9),
        _versus("W1 over HTTP vs llama.cpp", "kvloom serve >= 3x llama-server", named("kvloom-serve"),
                _best(run, ("llama.cpp",)), 3.0),
    ]
    for ours, theirs in ((offline, _best(run, ("vllm",))), (named("kvloom-serve"), _best(run, ("vllm-serve",)))):
        name, target = "peak RSS, whole process tree", "kvloom <= vLLM at the same KV budget"
        if not ours or not theirs or not ours["metrics"].get("peak_rss_mb") or not theirs["metrics"].get("peak_rss_mb"):
            goals.append(Goal(name, target, "–", None))
            continue
        a, b = ours["metrics"]["peak_rss_mb"], theirs["metrics"]["peak_rss_mb"]
        goals.append(Goal(name, target, f"{ours['spec']['name']} {a:.0f} MB vs {theirs['spec']['name']} {b:.0f} MB",
                          a <= b))
    eq = run.get("equality", {}).get("vllm-fp32")
    goals.append(Goal("greedy agreement in float32", "64/64 identical to vLLM float32",
                      "–" if eq is None else f"{eq['equal']}/{eq['compared']} (vs {eq['reference']})",
                      None if eq is None else eq["equal"] == eq["compared"] == 64))
    return goals


def latency_peer_goal(runs: list[dict], name: str, ours: str = "kvloom-serve") -> Goal:
    """TTFT and TPOT p50 and p99 of `kvloom serve` no worse than `vllm serve`'s (at the dtype the host runs it
    in) in every run (each arrival rate of `chat`, or one stream at a time)."""
    target = f"TTFT, TPOT p50/p99 <= vLLM's{' at each rate' if len(runs) > 1 else ''}"
    rows, met = [], True
    for run in runs:
        theirs = next((r["spec"]["name"] for r in run["results"] if r["spec"]["kind"] == "vllm-serve"), None)
        stats = {}
        for stat in ("ttft.p50", "ttft.p99", "tpot.p50", "tpot.p99"):
            a, b = metric(run, ours, stat), metric(run, theirs, stat)
            if a is None or b is None:
                return Goal(name, target, "–", None)
            stats[stat] = (a, b)
        met = met and all(a <= b for a, b in stats.values())
        rate = run["params"].get("rate")
        rows.append((f"{rate} req/s: " if rate is not None else "")
                    + "; ".join(f"{stat} {a * 1000:.0f} vs {b * 1000:.0f} ms" for stat, (a, b) in stats.items()))
    return Goal(name, target, " / ".join(rows), met)
