"""Multi-LoRA on W1: the base model alone against 1, 8 and 32 random adapters (ranks 8, 16 and 64 in turn, every
projection patched) spread over the requests uniformly and Zipf-skewed, and 100 registered adapters with max_loras 8
under the Zipf mix; and what loading an adapter cold costs. Each mix runs in a fresh process, one after another in
one run, so the ratios to the base come from one run on one host; `--repeats N` runs the base and every mix N times
in rounds, and the goals and ratios are the median of each round's ratio (this 2-core host's hour-to-hour noise
moved one mix's ratio by 0.1 between single runs: docs/performance.md). `--peers` adds vLLM's CPU build (set up by
benchmarks/peer_setup/vllm.sh, at the settings `external_peers.vllm_env` gives) on the same requests, adapters and
knobs right after kvloom: `vllm` its offline `LLM` with `enable_lora` (greedy outputs compared with kvloom's),
`vllm-serve` and `kvloom-serve` over HTTP, each request naming its adapter as `model`.

    python -m kvloom.benchmarks.lora [--requests 64] [--model smollm2] [--mixes NAME,...] [--repeats 1]
                                     [--peers vllm,...]

writes benchmarks/results/lora.{md,json} (adapters and per-system records under benchmarks/out/lora).
"""

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvloom.benchmarks.bench import environment, in_fresh_process, run_systems
from kvloom.benchmarks.external_peers import vllm_env
from kvloom.benchmarks.harness import BenchSettings, SystemSpec
from kvloom.benchmarks.random_weights import write_random_adapter
from kvloom.benchmarks.report import environment_lines
from kvloom.benchmarks.run_results import latency_cell, metric
from kvloom.benchmarks.workloads import Workload, default_corpus, make_workload
from kvloom.kernels.host_isa import auto_cpu_dtype, host_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RUNS_DIR = Path(__file__).resolve().parent / "out" / "lora"
RANKS = (8, 16, 64)
ZIPF_S = 1.1  # request share of the i-th most popular adapter ~ 1 / i^s
BASE = "base"


@dataclass(frozen=True)
class Mix:
    name: str
    adapters: int  # registered
    spread: str  # "uniform" | "zipf": how requests pick among them
    max_loras: int
    ranks: tuple[int, ...] = RANKS  # the i-th adapter's rank: ranks[i % len(ranks)]

    @property
    def names(self) -> list[str]:
        return [f"r{self.ranks[i % len(self.ranks)]}-{i}" for i in range(self.adapters)]


MIXES = (Mix("1 adapter", 1, "uniform", 1, (16,)), *(Mix(f"8 uniform r{r}", 8, "uniform", 8, (r,)) for r in RANKS),
         Mix("8 uniform", 8, "uniform", 8), Mix("8 zipf", 8, "zipf", 8), Mix("32 uniform", 32, "uniform", 32),
         Mix("32 zipf", 32, "zipf", 32), Mix("100 zipf max_loras 8", 100, "zipf", 8))


def make_adapters(model: str, names: set[str], root: Path) -> dict[str, str]:
    """Random PEFT adapters for `model`, named r<rank>-<i> (made once; kept under `root`)."""
    from kvloom.engine.model.model_config import ModelConfig
    from kvloom.engine.model.model_files import resolve_model_dir

    config = ModelConfig.from_dir(resolve_model_dir(model))
    paths = {}
    for name in sorted(names):
        path = root / name
        if not (path / "adapter_config.json").is_file():
            rank, seed = (int(part) for part in name.removeprefix("r").split("-"))
            write_random_adapter(path, config, rank, seed=seed, scale=0.02)
        paths[name] = str(path)
    return paths


def assign(workload: Workload, mix: Mix, seed: int = 0) -> Workload:
    """The same requests, each with an adapter drawn by the mix's spread."""
    names = mix.names
    rng = np.random.default_rng(seed)
    if mix.spread == "zipf":
        weights = 1 / np.arange(1, len(names) + 1) ** ZIPF_S
        picks = rng.choice(len(names), len(workload.requests), p=weights / weights.sum())
    else:
        picks = np.arange(len(workload.requests)) % len(names)
    requests = [replace(r, lora=names[i]) for r, i in zip(workload.requests, picks)]
    return Workload(workload.name, requests, {**workload.params, "lora_mix": mix.name})


def cold_load(model: str, adapters: dict[str, str], dtype: str) -> list[dict]:
    """Seconds from an adapter's name to its first generated token, loaded cold (read from disk) and warm, per rank."""
    from kvloom.engine.llm_engine import LLMEngine
    from kvloom.engine.sampling import SamplingParams

    names = list(adapters)
    engine = LLMEngine(model=model, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                       lora={"adapters": adapters, "max_loras": 1})
    engine.warm_up()
    rows = []
    for name in names:
        row = {"adapter": name}
        for state in ("cold", "warm"):
            start = time.perf_counter()
            engine.add_request(f"{name}-{state}", [1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0), lora=name)
            while engine.has_unfinished():
                engine.step()
            row[f"{state}_s"] = time.perf_counter() - start
        row["host_mb"] = engine.adapters.weights(engine.inputs.adapter(name)).nbytes / 2**20
        rows.append(row)
    return rows


def metrics_only(runs: dict) -> dict:
    """A repeat round's runs without their per-request and per-step records (the first round keeps them)."""
    kept = ("spec", "status", "metrics", "elapsed_s")
    return {mix: {**run, "results": [{k: result[k] for k in kept if k in result} for result in run["results"]]}
            for mix, run in runs.items()}


def rounds(doc: dict) -> list[dict]:
    """Each round's runs by mix (`--repeats`: the first is `runs`, the others `repeats`)."""
    return [doc["runs"], *doc.get("repeats", [])]


def ratios(doc: dict, mix: str) -> list[float]:
    """kvloom's output tok/s in `mix` over the base's, one a round."""
    found = []
    for runs in rounds(doc):
        base = metric(runs[BASE], BASE, "output_tok_s")
        ours = metric(runs[mix], mix, "output_tok_s") if mix in runs else None
        if ours and base:
            found.append(ours / base)
    return found


def ratio_cell(found: list[float]) -> str:
    """The median ratio, and the range where there were several rounds."""
    median = f"{statistics.median(found):.2f}x"
    return median if len(found) < 2 else f"{median} ({min(found):.2f}-{max(found):.2f}, {len(found)} runs)"


def goals(doc: dict) -> list[tuple[str, str, bool | None]]:
    rows = []
    checks = [(f"8 adapters of rank {r} mixed in every step: >= 0.85x the base model's W1 throughput",
               f"8 uniform r{r}", 0.85) for r in RANKS]
    checks += [("8 adapters of ranks 8, 16 and 64 mixed in every step: >= 0.85x the base", "8 uniform", 0.85),
               ("100 adapters, max_loras 8, Zipf mix: >= 0.75x the base, no request fails", "100 zipf max_loras 8",
                0.75)]
    for goal, mix, floor in checks:
        found = ratios(doc, mix)
        failed = [s["status"] for runs in rounds(doc)
                  for s in runs.get(mix, {}).get("results", []) if s["status"] != "ok"]
        rows.append((goal, ratio_cell(found) + (f" ({', '.join(failed)})" if failed else "") if found
                     else "not measured", (statistics.median(found) >= floor and not failed) if found else None))
    for how, ours, theirs in (("offline", None, "vllm"), ("over HTTP", "kvloom-serve", "vllm-serve")):
        against = [(mix, *pair) for mix in doc["runs"] if mix != BASE and (pair := versus(doc, mix, ours, theirs))]
        rows.append((f"at least 1.5x vLLM's CPU build with LoRA, {how}", "; ".join(
            f"{mix} {a / b:.2f}x" for mix, a, b in against) or f"not measured (`--peers {theirs}`)",
            all(a >= 1.5 * b for _, a, b in against) if against else None))
    return rows


def versus(doc: dict, mix: str, ours: str | None, theirs: str) -> tuple[float, float] | None:
    """Output tok/s of kvloom (`ours`: its peer kind, None offline) and of a vLLM kind in one mix's run."""
    run = doc["runs"][mix]
    a = metric(run, peer_name(ours, mix) if ours else mix, "output_tok_s")
    b = metric(run, peer_name(theirs, mix), "output_tok_s")
    return (a, b) if a and b else None


def peer_name(kind: str, mix: str) -> str:
    return f"{kind} {mix}"


def write_report(doc: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(doc, indent=1))
    lines = ["# Multi-LoRA: W1 with adapters mixed in every step", "", environment_lines(doc["environment"]),
             f"dtype {doc['dtype']}; {doc['num_requests']} W1 requests; regenerate with "
             f"`{doc['command']}` ({doc['wall_s'] / 60:.0f} min). Adapters: random, every projection "
             f"patched, ranks {', '.join(map(str, RANKS))} in turn unless the mix names one; Zipf s = {ZIPF_S}.", "",
             "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'–' if met is None else 'yes' if met else '**no**'} |" for g, m, met in goals(doc)]
    lines += ["", "## Throughput and latency", "",
              "The first round's figures; `vs base` is the median over the rounds.", "",
              "| mix | adapters | max_loras | out tok/s | vs base | TPOT p50 / p99 ms | TTFT p50 s | status |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, run in doc["runs"].items():
        result = run["results"][0]
        m = result["metrics"]
        mix = next((x for x in MIXES if x.name == name), None)
        if not m:
            lines.append(f"| {name} | – | – | – | – | – | – | {result['status']} |")
            continue
        lines.append(f"| {name} | {mix.adapters if mix else 0} | {mix.max_loras if mix else '–'} | "
                     f"{m['output_tok_s']:.1f} | {ratio_cell(ratios(doc, name)) if mix else '1.00x'} | "
                     f"{latency_cell(m['tpot'], 'p50', ms=True)} / {latency_cell(m['tpot'], 'p99', ms=True)} | "
                     f"{latency_cell(m['ttft'], 'p50', ms=False)} | "
                     f"{result['status']} |")
    compared = {mix: pairs for mix in doc["runs"]  # (offline, over HTTP) where vLLM ran either way
                if any(pairs := (versus(doc, mix, None, "vllm"), versus(doc, mix, "kvloom-serve", "vllm-serve")))}
    if compared:
        lines += ["", "## Against vLLM's CPU build", "",
                  f"vLLM {doc.get('vllm_settings', '')}, the same requests, adapters, max_loras, max_cpu_loras and "
                  "max_lora_rank, right after kvloom in the same run; over HTTP each request names its adapter as "
                  "`model`, streamed, all at once. With LoRA enabled vLLM's CPU platform turns its compilation off "
                  "(vllm/platforms/cpu.py: eager, its torch LoRA ops, `PunicaWrapperCPU`, which gather each token's "
                  "adapter weights); the base row runs at its default compilation. Offline greedy outputs compared "
                  "request by request (a float32 near-tie can flip one token, after which that text goes its own "
                  "way).", "",
                  "| mix | offline kvloom / vLLM out tok/s | ratio | outputs equal | HTTP kvloom / vLLM out tok/s | "
                  "ratio |", "|---|---:|---:|---|---:|---:|"]

        def cells(pair: tuple[float, float] | None) -> str:
            return f"{pair[0]:.1f} / {pair[1]:.1f} | {pair[0] / pair[1]:.2f}x" if pair else "– | –"

        for mix, (offline, served) in compared.items():
            same = doc["runs"][mix]["equality"].get(peer_name("vllm", mix), {})
            lines.append(f"| {mix} | {cells(offline)} | {same.get('equal', '–')} of {same.get('compared', '–')} | "
                         f"{cells(served)} |")
    lines += ["", "## Loading an adapter cold", "",
              "From the adapter's name to its first token of a 4-token prompt: cold reads and checks the PEFT files "
              "(configured adapters are checked at start but read when a request first needs one), warm finds it in "
              "host memory.", "",
              "| adapter | cold s | warm s | host MB |", "|---|---:|---:|---:|"]
    lines += [f"| {r['adapter']} | {r['cold_s']:.3f} | {r['warm_s']:.3f} | {r['host_mb']:.0f} |" for r in doc["cold"]]
    path = out / "lora.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.lora", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=64, help="W1 requests (64: the whole workload)")
    parser.add_argument("--mixes", default=",".join(m.name for m in MIXES), help="comma-separated mix names")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the base and every mix (median ratios)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--peers", default="", help="comma-separated: vllm (offline), vllm-serve and kvloom-serve "
                                                    "(over HTTP) on the same requests and adapters")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "kvloom.benchmarks.lora", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    dtype = auto_cpu_dtype(host_isa())
    settings = BenchSettings(model=args.model)
    workload = make_workload("offline-mixed", default_corpus(args.model), seed=0, num_requests=args.requests)
    mixes = [m for m in MIXES if m.name in args.mixes.split(",")]
    cold = {f"r{rank}-{i}" for i, rank in enumerate(RANKS)}
    adapters = make_adapters(args.model, cold.union(*(m.names for m in mixes)), RUNS_DIR / "adapters")
    peers = [p for p in args.peers.split(",") if p]
    with_vllm = any(p.startswith("vllm") for p in peers)

    def systems(name: str, lora: dict | None) -> list[SystemSpec]:
        engine = {"dtype": dtype, **({"lora": lora} if lora else {})}
        vllm = {"dtype": dtype, **({"lora": {**lora, "max_lora_rank": max(RANKS)}} if lora else {})}
        served = {"kvloom-serve": engine, "vllm-serve": vllm, "vllm": vllm}
        return [SystemSpec(name, "kvloom", engine=engine),
                *(SystemSpec(peer_name(peer, name), peer, engine=served[peer]) for peer in peers)]

    done = []
    for _ in range(args.repeats):
        runs = {BASE: run_systems(workload, systems(BASE, None), settings, RUNS_DIR / BASE, BASE)}
        for mix in mixes:
            lora = {"adapters": {n: adapters[n] for n in mix.names}, "max_loras": mix.max_loras,
                    "max_cpu_loras": max(mix.adapters, mix.max_loras)}
            runs[mix.name] = run_systems(assign(workload, mix), systems(mix.name, lora), settings,
                                         RUNS_DIR / mix.name.replace(" ", "-").replace(",", ""), mix.name)
        done.append(runs)
    doc = {"command": command, "environment": environment(settings), "dtype": dtype,
           "num_requests": len(workload.requests),
           "mixes": [asdict(m) for m in mixes], "runs": done[0], "repeats": [metrics_only(runs) for runs in done[1:]],
           "cold": in_fresh_process(cold_load, args.model, {n: adapters[n] for n in cold}, dtype),
           "wall_s": time.monotonic() - started,
           "vllm_settings": " ".join(f"{k}={v}" for k, v in vllm_env(settings).items()) if with_vllm else None}
    print(f"report: {write_report(doc, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
