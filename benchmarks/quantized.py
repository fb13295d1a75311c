"""`python -m kvloom.benchmarks.quantized`: the embedded SmolLM2's Q4_1 weights run as stored (`quantization: gguf`)
against its de-quantized copy at today's default dtype and against llama.cpp's server on the same GGUF file.

1. The floor: the bytes a batch-1 decode step reads (every linear and the LM head as each engine holds them, the
   norms; of the embedding table one row) over this host's read bandwidth, measured in the same run (a float sum
   over 1 GiB on the engines' threads, before the systems run and after: the higher, since a neighbour's load
   only ever lowers it).
2. Batch-1 decode (`single-stream`: one request at a time, 256-token prompts, 128 tokens out) and W1
   (`offline-mixed`), each system in its own process (the `kvloom bench` harness): kvloom offline de-quantized and
   quantized, and over HTTP `kvloom serve` quantized beside llama-server (the like-for-like pair). Then W1's
   offline systems again in alternating rounds (each round's order rotated): the offline ratios' goals take the
   median of the rounds' ratios, since one pass each drifts with the host's neighbours by more than they differ.
3. Quality, in float32: the quantized engine's greedy tokens against the de-quantized engine's on W1's first 16
   prompts (32 tokens each; the share of tokens before the first difference), and the perplexity of Python's own
   LICENSE.txt (its first 2,048 tokens in four 512-token windows, from prompt logprobs) under each.

Writes `benchmarks/results/quantized-<host key>.{md,json}`.
"""

import argparse
import gc
import json
import math
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from kvloom.benchmarks.bench import environment, run_systems
from kvloom.benchmarks.external_peers import llama_cpp_install
from kvloom.benchmarks.harness import BenchSettings, SystemSpec
from kvloom.benchmarks.workloads import default_corpus, make_workload
from kvloom.kernels.host_isa import host_isa

RESULTS = Path(__file__).parent / "results"
PARITY_PROMPTS, PARITY_TOKENS, PROMPT_CAP = 16, 32, 256
TEXT_TOKENS, WINDOW = 2048, 512
QUANTIZED = {"quantization": "gguf"}


def offline_systems() -> list[SystemSpec]:
    return [SystemSpec("kvloom-dequantized", "kvloom"), SystemSpec("kvloom-q4_1", "kvloom", engine=QUANTIZED),
            SystemSpec("kvloom-q4_1-int8", "kvloom", engine={"quantization": "gguf-int8"})]


def systems() -> list[SystemSpec]:
    return [*offline_systems(), SystemSpec("kvloom-serve-q4_1", "kvloom-serve", engine=QUANTIZED),
            SystemSpec("llama.cpp-q4_1", "llama.cpp", engine={"dtype": "q4_1"})]


def w1_rounds(w1, settings: BenchSettings, rounds: int, out: Path) -> list[dict[str, float | None]]:
    """W1's offline systems in `rounds` rounds, round i's order rotated by i: each round's output tok/s by name."""
    out_rounds = []
    for i in range(rounds):
        order = offline_systems()
        order = order[i % len(order):] + order[:i % len(order)]
        run = run_systems(w1, order, settings, out / str(i), label=f"W1 offline, round {i + 1} of {rounds}")
        out_rounds.append({spec.name: output_tok_s(run, spec.name) for spec in order})
    return out_rounds


def median_ratio(rounds: list[dict[str, float | None]], name: str, over: str) -> float | None:
    ratios = [r[name] / r[over] for r in rounds if r.get(name) and r.get(over)]
    return statistics.median(ratios) if ratios else None


def read_bandwidth_gb_s(threads: int) -> float:
    """Bytes per second a float sum reads from a 1 GiB tensor on `threads` threads (best of five)."""
    torch.set_num_threads(threads)
    data = torch.ones(1 << 28)
    best = math.inf
    for _ in range(6):  # the first touches the pages
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def decode_step_bytes(**engine) -> int:
    """What a batch-1 decode step of SmolLM2 reads of its weights, as an engine with these settings holds them."""
    from kvloom.engine.llm_engine import LLMEngine

    decoder = LLMEngine(model="smollm2", max_model_len=512, **engine).decoder
    embed = 0 if decoder.head_shares_embedding else decoder.embed.nbytes  # a lookup reads one row of it
    return decoder.weight_bytes() - embed


# quality's comparisons: name -> (dtype, quantization)
QUALITY_RUNS = {"float32": ("float32", "gguf"), "bfloat16": ("bfloat16", "gguf"),
                "bfloat16, int8": ("bfloat16", "gguf-int8")}


def quality(prompts: list[list[int]]) -> dict:
    """Greedy agreement and perplexity, quantized against de-quantized in the same dtype: float32 and bfloat16 as
    stored, and bfloat16 with int8 activations (`gguf-int8`: x quantized a block at a time on VNNI CPUs)."""
    from kvloom.benchmarks.workloads import load_tokenizer
    from kvloom.engine.llm import LLM
    from kvloom.engine.sampling import SamplingParams

    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = load_tokenizer("smollm2").encode(text, add_special_tokens=False)[:TEXT_TOKENS]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    greedy = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def shared_prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    by_dtype = {}
    for label, (dtype, quantization) in QUALITY_RUNS.items():
        tokens, perplexity = {}, {}
        for name, engine in (("dequantized", {}), ("q4_1", {"quantization": quantization})):
            llm = LLM("smollm2", dtype=dtype, **engine)
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            # each position's entry: (its token's rank, {token: logprob, its top alternatives...}), the token first
            logprobs = [next(iter(alternatives.values())) for out in llm.generate(windows, scoring)
                        for _, alternatives in filter(None, out.prompt_logprobs)]
            perplexity[name] = math.exp(-sum(logprobs) / len(logprobs))
            del llm
            gc.collect()
        prefixes = [shared_prefix(a, b) for a, b in zip(tokens["q4_1"], tokens["dequantized"])]
        by_dtype[label] = {"equal_prefix_tokens": prefixes, "perplexity": perplexity,
                           "equal_share": sum(prefixes) / (len(prompts) * PARITY_TOKENS)}
    return {"prompts": len(prompts), "tokens": PARITY_TOKENS, "text": "Python's LICENSE.txt", "text_tokens": len(ids),
            **by_dtype}


def markdown(report: dict) -> str:
    floor, env = report["floor"], report["environment"]
    lines = [f"# Quantized weights: SmolLM2 Q4_1 run as stored ({env['cpu']})", "",
             f"Commit {env['commit']}, {env['threads']} threads, torch {env['torch']}; `python -m "
             f"kvloom.benchmarks.quantized`. llama.cpp: llama-server built from the llama-cpp-python sdist with "
             f"-march=native, `--threads {env['threads']} --threads-batch {env['threads']}`, continuous batching, on "
             "the same GGUF file kvloom loads.", "",
             f"Read bandwidth measured in this run: {floor['read_gb_s']:.1f} GB/s (before the systems ran "
             f"{floor['read_gb_s_before']:.1f}, after {floor['read_gb_s_after']:.1f}). A batch-1 decode step reads "
             f"{floor['quantized_mb']:.1f} MB quantized ({floor['quantized_floor_ms']:.2f} ms at that rate) and "
             f"{floor['dequantized_mb']:.1f} MB de-quantized ({floor['dequantized_floor_ms']:.2f} ms).", ""]
    for run in report["runs"]:
        lines += [f"## {run['label']} ({run['num_requests']} requests)", "",
                  "| system | status | output tok/s | TTFT p50 s | TPOT p50 ms | TPOT p99 ms | peak RSS MB |",
                  "|---|---|---|---|---|---|---|"]
        for r in run["results"]:
            m = r["metrics"]
            if m is None:
                lines.append(f"| {r['spec']['name']} | {r['status']} | | | | | |")
                continue
            tpot = m["tpot"] or {"p50": math.nan, "p99": math.nan}
            lines.append(f"| {r['spec']['name']} | {r['status']} | {m['output_tok_s']:.1f} | "
                         f"{m['ttft']['p50']:.3f} | {tpot['p50'] * 1e3:.2f} | {tpot['p99'] * 1e3:.2f} | "
                         f"{m['peak_rss_mb'] or 0:.0f} |")
        lines.append("")
    rounds = report["w1_rounds"]
    if rounds:
        names = [spec.name for spec in offline_systems()]
        lines += [f"## W1 offline, {len(rounds)} alternating rounds (output tok/s)", "",
                  "| round | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {i + 1} | " + " | ".join(f"{r[n]:.1f}" if r.get(n) else "-" for n in names) + " |"
                  for i, r in enumerate(rounds)]
        lines.append("")
    q = report["quality"]
    lines += ["## Quality", "", "Q4_1 run as stored against the de-quantized engine in the same dtype (`bfloat16, "
              "int8`: `quantization: gguf-int8`, x in int8 at every batch size on VNNI CPUs).", ""]
    for dtype in QUALITY_RUNS:
        d, pp = q[dtype], q[dtype]["perplexity"]
        lines += [f"- {dtype}: greedy tokens equal on {d['equal_share']:.1%} of {q['prompts']} prompts x {q['tokens']} "
                  f"tokens (before each prompt's first difference: {d['equal_prefix_tokens']}); perplexity of "
                  f"{q['text']} ({q['text_tokens']} tokens) de-quantized {pp['dequantized']:.4f}, Q4_1 as stored "
                  f"{pp['q4_1']:.4f} ({pp['q4_1'] / pp['dequantized'] - 1:+.3%})."]
    lines += ["", "## Goals", ""] + [f"- {g}" for g in report["goals"]]
    return "\n".join(lines) + "\n"


def metrics_of(run: dict, name: str) -> dict | None:
    """The named system's metrics in one of the runs, or None where it did not finish."""
    return next((r["metrics"] for r in run["results"] if r["spec"]["name"] == name and r["metrics"]), None)


def tpot_ms(run: dict, name: str) -> float | None:
    metrics = metrics_of(run, name)
    return metrics["tpot"]["p50"] * 1e3 if metrics and metrics["tpot"] else None


def output_tok_s(run: dict, name: str) -> float | None:
    metrics = metrics_of(run, name)
    return metrics["output_tok_s"] if metrics else None


def goals(report: dict) -> list[str]:
    """Each goal of issue 72 this run measures, with its figure; None-safe where a system did not run."""
    single, w1 = report["runs"]
    floor, q = report["floor"], report["quality"]
    out = []

    def ratio(a, b):
        return None if a is None or b is None else a / b

    def line(text: str, value, goal: float, better_high: bool = True) -> None:
        if value is None:
            out.append(f"{text}: not measured (a system did not finish)")
            return
        held = value >= goal if better_high else value <= goal
        out.append(f"{text}: {value:.2f}x (goal {'at least' if better_high else 'at most'} {goal}x): "
                   f"{'holds' if held else 'missed'}")

    line("batch-1 TPOT over the quantized read floor", ratio(tpot_ms(single, "kvloom-q4_1"),
                                                            floor["quantized_floor_ms"]), 1.3, better_high=False)
    line("batch-1 TPOT, de-quantized over quantized", ratio(tpot_ms(single, "kvloom-dequantized"),
                                                           tpot_ms(single, "kvloom-q4_1")), 2.0)
    line("batch-1 TPOT over HTTP, llama.cpp over kvloom serve", ratio(tpot_ms(single, "llama.cpp-q4_1"),
                                                                     tpot_ms(single, "kvloom-serve-q4_1")), 1.2)
    line("W1 throughput over HTTP, kvloom serve over llama.cpp", ratio(output_tok_s(w1, "kvloom-serve-q4_1"),
                                                                      output_tok_s(w1, "llama.cpp-q4_1")), 2.0)
    rounds = report["w1_rounds"] or [{spec.name: output_tok_s(w1, spec.name) for spec in offline_systems()}]
    which = f"median of {len(rounds)} rounds" if len(rounds) > 1 else "one pass each"
    line(f"W1 offline throughput, quantized over de-quantized ({which})",
         median_ratio(rounds, "kvloom-q4_1", "kvloom-dequantized"), 1.0)
    line(f"W1 offline throughput, quantized with int8 activations over de-quantized ({which})",
         median_ratio(rounds, "kvloom-q4_1-int8", "kvloom-dequantized"), 1.0)
    for dtype in QUALITY_RUNS:
        line(f"{dtype}: greedy tokens equal to the de-quantized engine's (share, as x)", q[dtype]["equal_share"], 0.9)
        pp = q[dtype]["perplexity"]
        line(f"{dtype}: perplexity, quantized over de-quantized", pp["q4_1"] / pp["dequantized"], 1.005,
             better_high=False)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.quantized", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-requests", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/quantized"))
    parser.add_argument("--w1-rounds", type=int, default=3, help="W1's offline systems again, alternating (0: none)")
    parser.add_argument("--runs-from", type=Path, default=None,
                        help="the systems' runs saved by an earlier run (its --out/runs.json): measure the rest only")
    args = parser.parse_args(argv)
    settings = BenchSettings(threads=args.threads)
    if not llama_cpp_install().ready:
        print(f"llama.cpp is {llama_cpp_install().missing}; its rows will say so")
    corpus = default_corpus()
    single = make_workload("single-stream", corpus, num_requests=args.single_requests)
    w1 = make_workload("offline-mixed", corpus)
    before = read_bandwidth_gb_s(args.threads)
    if args.runs_from:
        saved = json.loads(args.runs_from.read_text())
        runs, rounds = saved["runs"], saved["w1_rounds"]
    else:
        runs = [run_systems(workload, systems(), settings, args.out / workload.name, label=label)
                for workload, label in ((single, "Batch-1 decode (single-stream)"), (w1, "W1 (offline-mixed)"))]
        rounds = w1_rounds(w1, settings, args.w1_rounds, args.out / "w1-rounds")
        (args.out / "runs.json").write_text(json.dumps({"runs": runs, "w1_rounds": rounds}, default=str))
    after = read_bandwidth_gb_s(args.threads)
    bandwidth = max(before, after)
    quantized, dequantized = decode_step_bytes(quantization="gguf"), decode_step_bytes()
    floor = {"read_gb_s": bandwidth, "read_gb_s_before": before, "read_gb_s_after": after,
             "quantized_mb": quantized / 1e6, "dequantized_mb": dequantized / 1e6,
             "quantized_floor_ms": quantized / bandwidth / 1e6, "dequantized_floor_ms": dequantized / bandwidth / 1e6}
    prompts = [r.prompt[:PROMPT_CAP] for r in w1.with_token_ids("smollm2").requests[:PARITY_PROMPTS]]
    report = {"environment": environment(settings), "floor": floor, "runs": runs, "w1_rounds": rounds,
              "quality": quality(prompts)}
    report["goals"] = goals(report)
    stem = RESULTS / f"quantized-{host_isa().build_key}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
