"""What prompt logprobs cost: W1's 64 prompts (16-512 tokens) through the offline engine, each generating one
token, with and without `prompt_logprobs`, in alternating rounds (paired: the host's drift hits both alike).
The ratio of their times is the goal's (at most 1.2x); a run without them is today's path.

Run: `python -m kvloom.benchmarks.prompt_logprobs [--rounds 5]`; writes `benchmarks/results/prompt-logprobs.{md,json}`.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.workloads import default_corpus, make_workload
from kvloom.engine.llm import LLM
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.host_isa import host_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL = 1.2


def timed(llm: LLM, prompts: list[list[int]], prompt_logprobs: int | None) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=prompt_logprobs)
    started = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.prompt_logprobs", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    prompts = [r.prompt for r in make_workload("offline-mixed", default_corpus(), seed=0).requests]
    llm = LLM("smollm2", enable_prefix_caching=False)  # each round computes every prompt, with logprobs or not
    timed(llm, prompts[:4], 1)  # warm-up
    rounds = []
    for i in range(args.rounds):
        order = [None, 1] if i % 2 == 0 else [1, None]
        times = {str(k): timed(llm, prompts, k) for k in order}
        rounds.append({"without": times["None"], "with": times["1"], "ratio": times["1"] / times["None"]})
        print(f"[prompt-logprobs] round {i}: {rounds[-1]}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    doc = {"commit": source_commit(), "host": host_isa().describe(), "prompt_tokens": sum(map(len, prompts)),
           "rounds": rounds, "median_ratio": ratio}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompt-logprobs.json").write_text(json.dumps(doc, indent=1))
    lines = ["# What prompt logprobs cost", "",
             f"`python -m kvloom.benchmarks.prompt_logprobs` at {doc['commit']} on {doc['host']}: W1's 64 prompts "
             f"({doc['prompt_tokens']} tokens, 16-512 each) through the offline engine (SmolLM2, dtype auto, prefix "
             "cache off), one generated token each, with `prompt_logprobs: 1` and without, in alternating rounds.", "",
             "| round | without (s) | with (s) | ratio |", "|---:|---:|---:|---:|",
             *(f"| {i} | {r['without']:.2f} | {r['with']:.2f} | {r['ratio']:.2f} |" for i, r in enumerate(rounds)), "",
             f"Median ratio {ratio:.2f}x (rounds {min(r['ratio'] for r in rounds):.2f}-"
             f"{max(r['ratio'] for r in rounds):.2f}x) against the goal's {GOAL}x: "
             f"{'met' if ratio <= GOAL else '**missed**'}. Where the time goes: docs/performance.md.", ""]
    (args.out / "prompt-logprobs.md").write_text("\n".join(lines))
    print(f"[prompt-logprobs] median ratio {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
