"""Render benchmark results (the JSON-ready dicts of `bench`) as markdown tables and PNG plots.

Everything here reads plain dicts, so a saved JSON re-renders without running anything.
"""

import json
from pathlib import Path

import numpy as np

from kvloom.benchmarks.metrics import acceptance
from kvloom.benchmarks.run_results import cpu_efficiency, latency_cell, metric
from kvloom.benchmarks.serving_cpu import serving_cpu_line

LATENCIES = ("ttft", "tpot", "e2e")
COLUMNS = ("<sub>mean batch: requests computed per step; idle: slot-steps held by finished members of a batch "
           "(static/dynamic wait for the longest; hf-static computes them) over all held slot-steps; padding: "
           "prompt padding to the batch's longest prompt over padded + real prompt tokens (hf-static computes it, "
           "kvloom only counts it); KV: share of the KV budget in use per step, mean / peak; CPU s: process CPU "
           "time of the run (both threads; 2 per wall second on an idle machine); load: 1-minute load average at its end (the machine is shared); "
           "spec accept / len: drafted tokens accepted / tokens a verifying step yields per request; outputs equal: "
           "greedy outputs identical to the reference, over the requests both ran.</sub>")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok(run: dict) -> list[dict]:
    return [r for r in run["results"] if r["metrics"]]


def _fmt(value, spec: str = ".2f", scale: float = 1.0, missing: str = "–") -> str:
    if value is None:
        return missing
    return format(value * scale if scale != 1 else value, spec)


def _pct(value) -> str:
    return _fmt(value, ".0%")


def _match(run: dict, name: str) -> str:
    eq = run.get("equality", {}).get(name)
    if eq is not None:
        return f"{eq['equal']}/{eq['compared']}"
    compared = {e["reference"] for e in run.get("equality", {}).values()}
    return "reference" if name in compared else "–"  # an HTTP peer streams text, not token ids


def spec_cell(m: dict) -> str:
    """Speculative decoding's acceptance rate and mean accepted length, or a dash where it did not run."""
    rate_length = acceptance(m.get("spec_decode"))
    return f"{rate_length[0]:.0%} / {rate_length[1]:.2f}" if rate_length else "–"


def results_table(run: dict) -> str:
    """One row per system: throughput, latency percentiles, batch efficiency, memory, output check."""
    head = ("| system | status | req | out tok/s | total tok/s | req/s | TTFT p50/p90/p99 s | "
            "TPOT p50/p90/p99 ms | E2E p50/p90/p99 s | mean batch | idle | padding | KV mean/peak | "
            "prefix hit | preempt | spec accept / len | peak RSS MB | CPU s | out tok per CPU s | load | outputs equal |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in run["results"]:
        m = r["metrics"]
        name = r["spec"]["name"]
        if not m:
            rows.append(f"| {name} | {r['status']} |" + " – |" * (head.count("|") - 3))
            continue
        lat = [" / ".join(latency_cell(m[k], q, ms=(k == "tpot")) for q in ("p50", "p90", "p99")) for k in LATENCIES]
        rows.append(
            f"| {name} | {r['status']} | {m['num_requests']} | {m['output_tok_s']:.1f} | {m['total_tok_s']:.1f} | "
            f"{m['requests_s']:.3f} | {lat[0]} | {lat[1]} | {lat[2]} | {_fmt(m['mean_batch_size'], '.1f')} | "
            f"{_pct(m['idle_ratio'])} | {_pct(m['padding_ratio'])} | "
            f"{_pct(m['kv_usage_mean'])} / {_pct(m['kv_usage_peak'])} | {_pct(m['prefix_hit_rate'])} | "
            f"{_fmt(m['preemptions'], 'd')} | {spec_cell(m)} | {_fmt(m['peak_rss_mb'], '.0f')} | {_fmt(m.get('cpu_s'), '.0f')} | "
            f"{_fmt(cpu_efficiency(m), '.1f')} | {_fmt(m.get('load_avg'), '.1f')} | {_match(run, name)} |")
    return "\n".join(rows)


def headline_table(run: dict) -> str:
    """The short table (for a README): throughput and the latencies users feel, per system."""
    rows = ["| system | requests | output tok/s | total tok/s | TTFT p50 s | TPOT p50 / p99 ms | mean batch | "
            "spec accept / len |", "|---|---|---|---|---|---|---|---|"]
    for r in _ok(run):
        m = r["metrics"]
        rows.append(f"| {r['spec']['name']} | {m['num_requests']} | {m['output_tok_s']:.1f} | {m['total_tok_s']:.1f} | "
                    f"{latency_cell(m['ttft'], 'p50', ms=False)} | {latency_cell(m['tpot'], 'p50', ms=True)} / "
                    f"{latency_cell(m['tpot'], 'p99', ms=True)} | {_fmt(m['mean_batch_size'], '.1f')} | {spec_cell(m)} |")
    return "\n".join(rows)


def notes(run: dict) -> str:
    """Every system's notes (subsets, time limits) and every output mismatch, spelled out."""
    lines = []
    for r in run["results"]:
        for note in (r["metrics"] or {}).get("notes", []):
            lines.append(f"- {r['spec']['name']}: {note}")
        if (m := r["metrics"] or {}).get("engine_busy_s") is not None:
            lines.append(f"- {r['spec']['name']}: engine {m['num_steps']} steps, mean batch {m['mean_batch_size']:.1f}, "
                         f"in steps {m['engine_busy_s']:.1f} s of the run's {m['wall_s']:.1f} "
                         f"({1000 * m['engine_busy_s'] / m['num_steps']:.0f} ms a step)")
        if cpu := (r["metrics"] or {}).get("cpu_by_role"):
            lines.append(f"- {r['spec']['name']}: {serving_cpu_line(cpu)}")
        if r["status"] not in ("ok",):
            lines.append(f"- {r['spec']['name']}: {r['status']}")
    for name, eq in run.get("equality", {}).items():
        if eq["mismatches"]:
            where = ", ".join(f"{m['id']} at token {m['first_diff']}/{m['length']}" for m in eq["mismatches"][:6])
            more = f" (+{len(eq['mismatches']) - 6} more)" if len(eq["mismatches"]) > 6 else ""
            lines.append(f"- {name} vs {eq['reference']}: {len(eq['mismatches'])} of {eq['compared']} outputs "
                         f"differ, first divergence: {where}{more}")
        else:
            lines.append(f"- {name} vs {eq['reference']}: all {eq['compared']} outputs identical")
    return "\n".join(lines)


# ---- plots --------------------------------------------------------------------------------------
def plot_throughput(run: dict, path: Path) -> Path:
    plt = pyplot()
    results = _ok(run)
    names = [r["spec"]["name"] for r in results]
    out = [r["metrics"]["output_tok_s"] for r in results]
    total = [r["metrics"]["total_tok_s"] for r in results]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4))
    ax.bar(x - 0.2, out, 0.4, label="output tok/s")
    ax.bar(x + 0.2, total, 0.4, label="total tok/s (prompt + output)")
    for xi, v in zip(x, out):
        ax.annotate(f"{v:.0f}", (xi - 0.2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [n + ("*" if r["spec"]["num_requests"] else "") for n, r in zip(names, results)],
                  rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{run['label']}: throughput by system (* = stated subset)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(run: dict, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, unit in zip(axes, LATENCIES, ("s", "ms", "s")):
        for r in _ok(run):
            values = np.sort([q[key] * (1000 if unit == "ms" else 1) for q in r["requests"] if q[key] is not None])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=r["spec"]["name"])
        ax.set_xlabel(f"{key.upper()} ({unit})")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{run['label']}: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rate_sweep(runs: list[dict], path: Path) -> Path:
    """Throughput and tail latency against offered load, one line per system."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    systems = [r["spec"]["name"] for r in runs[0]["results"]]
    rates = [run["params"]["rate"] for run in runs]
    for name in systems:
        ax1.plot(rates, [metric(run, name, "output_tok_s") for run in runs], "o-", label=name)
        ax2.plot(rates, [metric(run, name, "ttft.p99") for run in runs], "o-", label=name)
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("output tok/s")
    ax1.set_title("throughput vs offered load")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("p99 TTFT (s)")
    ax2.set_yscale("log")
    ax2.set_title("tail latency vs offered load")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tradeoff(sweep: dict, path: Path) -> Path:
    """Throughput against p99 TPOT for each swept value, with the latency budget marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    points = [(p["value"], p["tpot_p99_s"] * 1000, p["output_tok_s"]) for p in sweep["points"] if p["output_tok_s"]]
    ax.plot([p[1] for p in points], [p[2] for p in points], "o-")
    for value, x, y in points:
        ax.annotate(f"{sweep['param']}={value}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    if sweep.get("tpot_budget_s"):
        ax.axvline(sweep["tpot_budget_s"] * 1000, color="red", ls="--", label="p99 TPOT budget")
        ax.legend()
    ax.set_xlabel("p99 TPOT (ms)")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{sweep['label']}: throughput vs latency over {sweep['param']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- sections -----------------------------------------------------------------------------------
def run_section(run: dict, out_dir: Path, stem: str, title: str) -> str:
    """A run's table, notes and its two plots (written next to the markdown)."""
    tput = plot_throughput(run, out_dir / f"{stem}-throughput.png")
    cdf = plot_latency_cdfs(run, out_dir / f"{stem}-latency.png")
    params = ", ".join(f"{k}={v}" for k, v in run["params"].items())
    parts = [f"## {title}", f"Workload `{run['workload']}` ({params}): {run['num_requests']} requests, "
             f"{run['output_tokens']} output tokens.", "", results_table(run), "", COLUMNS]
    if (n := notes(run)):
        parts += ["", n]
    parts += ["", f"![throughput]({tput.name})", f"![latency CDFs]({cdf.name})"]
    return "\n".join(parts)


def rate_section(runs: list[dict], out_dir: Path, stem: str) -> str:
    plot = plot_rate_sweep(runs, out_dir / f"{stem}-rates.png")
    head = "| rate (req/s) | " + " | ".join(r["spec"]["name"] for r in runs[0]["results"]) + " |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        cells = [f"{_fmt(metric(run, r['spec']['name'], 'output_tok_s'), '.1f')} tok/s, p99 TTFT "
                 f"{_fmt(metric(run, r['spec']['name'], 'ttft.p99'), '.1f')} s" for r in run["results"]]
        rows.append(f"| {run['params']['rate']} | " + " | ".join(cells) + " |")
    return "\n".join(["## `chat`: throughput vs request rate", "\n".join(rows), "",
                      f"![throughput vs rate]({plot.name})"])


def sweep_section(sweep: dict, out_dir: Path, stem: str) -> str:
    plot = plot_tradeoff(sweep, out_dir / f"{stem}-tradeoff.png")
    rows = [f"| {sweep['param']} | out tok/s | p99 TPOT ms | p99 TTFT s | mean batch |", "|---|---|---|---|---|"]
    for p in sweep["points"]:
        rows.append(f"| {p['value']} | {_fmt(p['output_tok_s'], '.1f')} | {_fmt(p['tpot_p99_s'], '.0f', 1000)} | "
                    f"{_fmt(p['ttft_p99_s'], '.1f')} | {_fmt(p['mean_batch_size'], '.1f')} |")
    best = sweep.get("best")
    same = [p["value"] for p in sweep["points"] if p["value"] >= sweep.get("num_requests", float("inf"))]
    if len(same) > 1:
        rows.append(f"\n{', '.join(map(str, same))} are at least the workload's {sweep['num_requests']} requests: "
                    "they schedule identically, so their difference is noise.")
    verdict = (f"Best setting within a p99 TPOT budget of {sweep['tpot_budget_s'] * 1000:.0f} ms: "
               f"**{sweep['param']}={best['value']}** ({best['output_tok_s']:.1f} out tok/s, p99 TPOT "
               f"{best['tpot_p99_s'] * 1000:.0f} ms)." if best else
               f"No setting meets a p99 TPOT budget of {sweep['tpot_budget_s'] * 1000:.0f} ms.")
    return "\n".join([f"## Sweep of `{sweep['param']}` ({sweep['label']})", "\n".join(rows), "", verdict, "",
                      f"![trade-off]({plot.name})"])


def roofline_section(machine: dict, run: dict, system: str) -> str:
    wall = metric(run, system, "wall_s")
    lines = [
        "## Roofline",
        f"fp32 GEMM with the model's weight shapes, {run['workload']} FLOPs counted from its tokens:",
        f"- GEMM rate at M={machine['decode_m']} (decoder linears + LM head): "
        f"{machine['decode_rate'] / 1e9:.1f} GFLOP/s; "
        f"at M={machine['prefill_m']} (decoder linears): {machine['prefill_rate'] / 1e9:.1f} GFLOP/s; "
        f"at M=32: {machine['rate_m32'] / 1e9:.1f} GFLOP/s",
        f"- model FLOPs: prefill {machine['prefill_flops'] / 1e12:.2f} TFLOP, "
        f"decode {machine['decode_flops'] / 1e12:.2f} TFLOP",
        f"- compute roofline {machine['roofline_s']:.1f} s; `{system}` wall {_fmt(wall, '.1f')} s = "
        f"**{_fmt(wall / machine['roofline_s'] if wall else None, '.2f')}x roofline**",
        "",
        f"Decode probes: the decode-only steps of `{system}`'s run at batch 64 (and 28-36), FLOPs counted per "
        "step; \"by CPU time\" takes the step's CPU time over its threads as its duration (what it would take "
        "with the cores to itself).",
        "",
        "| probe | steps | mean context | step ms | forward ms | outside forward | CPU ms | GFLOP/s "
        "| GEMM GFLOP/s at M | efficiency | by CPU time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in machine.get("probes", []):
        lines.append(f"| batch {p['batch']:.1f} | {p['num_steps']} | {p['context']:.0f} | {p['step_s'] * 1000:.0f} | "
                     f"{p['forward_s'] * 1000:.0f} | {p['overhead']:.1%} | {_fmt(p.get('cpu_s'), '.0f', 1000)} | "
                     f"{p['flops_per_s'] / 1e9:.1f} | {p['gemm_rate'] / 1e9:.1f} | {p['efficiency']:.0%} | "
                     f"{_pct(p.get('cpu_efficiency'))} |")
    return "\n".join(lines)


def environment_lines(env: dict) -> str:
    s = env["settings"]
    return (f"kvloom `{env.get('commit', 'unknown')}` on machine `{env['host']}`: {env.get('cpu', '?')}, "
            f"{env['cpus']} CPUs, torch {env['torch']}, transformers {env['transformers']}; "
            f"kvloom dtype auto = {env.get('auto_dtype', 'float32')} here; "
            f"torch threads {env['threads']} for every system, OMP_WAIT_POLICY={env['omp_wait_policy']}, "
            f"GOMP_SPINCOUNT={env.get('gomp_spincount', 'default')}. "
            f"Shared settings: max_num_seqs={s['max_num_seqs']}, max_num_batched_tokens={s['max_num_batched_tokens']}, "
            f"KV budget {s['kv_cache_memory_bytes'] / 2**30:.1f} GiB, prefix caching "
            f"{'on' if s['enable_prefix_caching'] else 'off'}, per-system limit {s['timeout_s']:.0f} s, "
            f"hf-cb attention `{s['hf_cb_attention']}`.")


def peer_goals_section(runs: list[dict]) -> str:
    """Issue 17's goals: W1's ratios against vLLM and llama.cpp, or latencies over HTTP against `vllm serve`
    (`chat` at every rate run, one stream at a time); other workloads have none."""
    from kvloom.benchmarks.goals import goals_table, latency_peer_goal, peer_goals

    workload = runs[0]["workload"]
    if workload == "offline-mixed":
        goals = peer_goals(runs[0])
    elif workload in ("chat", "single-stream"):
        goals = [latency_peer_goal(runs, f"{workload} over HTTP vs vllm serve")]
    else:
        return ""
    return "## Against vLLM and llama.cpp\n\n" + goals_table(goals)


def write_bench_report(doc: dict, out_dir: Path, stem: str = "bench") -> Path:
    """JSON, markdown and PNGs of one `kvloom bench` invocation."""
    from kvloom.benchmarks.external_peers import KINDS as EXTERNAL_KINDS  # it imports the engine: only here

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    parts = [f"# kvloom bench: {doc['title']}", environment_lines(doc["environment"])]
    runs = doc["runs"]
    for i, run in enumerate(runs):
        parts.append(run_section(run, out_dir, f"{stem}-{i}" if len(runs) > 1 else stem, run["label"]))
    if len(runs) > 1 and all("rate" in run["params"] for run in runs):
        parts.append(rate_section(runs, out_dir, stem))
    if any(r["spec"]["kind"] in ("vllm", "vllm-serve") for run in runs for r in run["results"]):
        settings = " ".join(f"{k}={v}" for k, v in doc["environment"].get("vllm_env", {}).items())
        parts.append(f"vLLM ran with `{settings or 'its defaults (before 2026-11-29: untuned)'}`.")
    if any(r["spec"]["kind"] in EXTERNAL_KINDS for run in runs for r in run["results"]):
        parts.append(peer_goals_section(runs))
    parts = [part for part in parts if part]
    if doc.get("machine"):
        parts.append(roofline_section(doc["machine"], runs[0], doc["roofline_system"]))
    if doc.get("sweep"):
        parts.append(sweep_section(doc["sweep"], out_dir, stem))
    path = out_dir / f"{stem}.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path
