"""What the Responses API adds to time to first token: streamed requests through `/v1/chat/completions` and through
`/v1/responses` against one SmolLM2 replica (local Ray + Serve, loopback), one request at a time, in pairs whose
order alternates (the host's drift hits both alike). Every request has a prompt of its own (no prefix-cache hit
favours either), of the same length within a pair. TTFT: from sending the request to its first text (chat: the
first chunk with content; Responses: the first `response.output_text.delta` event).

Run: `python -m kvloom.benchmarks.responses_ttft [--pairs 60]`; writes `benchmarks/results/responses-ttft.{md,json}`.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.workloads import synthetic_text
from kvloom.cluster.config import ClusterConfig
from kvloom.kernels.host_isa import host_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL = 1.05
WORDS = 150  # a prompt's words (~200 tokens)


def chat_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    return any(choice["delta"].get("content") for choice in json.loads(line[len("data: "):])["choices"])


def responses_text(line: str) -> bool:
    return line == "event: response.output_text.delta"


def ttft(client: httpx.Client, api: str, prompt: str) -> float:
    """Seconds to the first text of one streamed request."""
    if api == "chat":
        path, body, first = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}, chat_text
    else:
        path, body, first = "/v1/responses", {"input": prompt, "store": False}, responses_text
    body |= {"model": "smollm2", "stream": True, "max_tokens" if api == "chat" else "max_output_tokens": 4,
             "temperature": 0}
    started = time.perf_counter()
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if first(line):
                elapsed = time.perf_counter() - started
                break
        else:
            raise RuntimeError(f"{api}: no text in the stream")
        for _ in lines:  # the rest, so the next request finds the replica idle
            pass
    return elapsed


def measure(base: str, pairs: int) -> list[dict]:
    words = synthetic_text(WORDS * (2 * pairs + 4)).split()
    prompts = iter(" ".join(words[i:i + WORDS]) for i in range(0, len(words) - WORDS + 1, WORDS))
    rounds = []
    with httpx.Client(base_url=base, timeout=120) as client:
        for api in ("chat", "responses"):  # warm-up
            ttft(client, api, next(prompts))
        for i in range(pairs):
            order = ["chat", "responses"] if i % 2 == 0 else ["responses", "chat"]
            times = {api: ttft(client, api, next(prompts)) for api in order}
            rounds.append({"chat_s": times["chat"], "responses_s": times["responses"]})
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.responses_ttft",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    from kvloom.benchmarks.local_serve import local_serve
    from kvloom.cluster.app import deploy

    config = ClusterConfig.model_validate({"num_replicas": 1})
    with local_serve() as base:
        deploy(config)
        rounds = measure(base, args.pairs)
    chat = statistics.median(r["chat_s"] for r in rounds)
    responses = statistics.median(r["responses_s"] for r in rounds)
    paired = statistics.median(r["responses_s"] / r["chat_s"] for r in rounds)
    doc = {"commit": source_commit(), "host": host_isa().describe(), "pairs": args.pairs,
           "median_chat_ttft_s": chat, "median_responses_ttft_s": responses, "median_paired_ratio": paired,
           "rounds": rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "responses-ttft.json").write_text(json.dumps(doc, indent=1))
    lines = ["# What the Responses API adds to time to first token", "",
             f"`python -m kvloom.benchmarks.responses_ttft --pairs {args.pairs}` at {doc['commit']} on {doc['host']}: "
             f"one SmolLM2 replica (the default config), {args.pairs} pairs of streamed requests, one at a time, "
             f"each with its own prompt of {WORDS} words, 4 tokens generated, the order within a pair alternating.", "",
             "| API | median TTFT (ms) | p90 TTFT (ms) |", "|---|---:|---:|",
             *(f"| {name} | {1000 * statistics.median(v):.1f} | {1000 * statistics.quantiles(v, n=10)[-1]:.1f} |"
               for name, v in (("chat completions", [r["chat_s"] for r in rounds]),
                               ("responses", [r["responses_s"] for r in rounds]))), "",
             f"Median paired ratio (responses / chat) {paired:.3f}x against the goal's {GOAL}x: "
             f"{'met' if paired <= GOAL else '**missed**'}.", ""]
    (args.out / "responses-ttft.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
