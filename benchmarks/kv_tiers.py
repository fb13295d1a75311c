"""What KV tiers buy: multi-turn chat whose working set is several times the KV pool, through the offline engine
on SmolLM2, with tiers off, a host tier, and host + disk (scenario (a) of issue 71; the router scenarios (b) and (c)
and vLLM's CPU build are not in this version).

Conversations share a system prompt and grow a turn at a time: every conversation's turn t runs (all of them
together, `--batch` at once in the engine), then every conversation's turn t + 1, so between two turns of one
conversation the others push its history out of the pool. A turn's prompt is the system prompt, its history (each
earlier turn's question and the tokens generated for it) and a new question. TTFT: from a round's start to the
request's first token; throughput: generated tokens over the whole run's wall time. Also: a block's load time from
the host tier per token against the engine's prefill time per token, both measured in the run.

Run: `python -m kvloom.benchmarks.kv_tiers [--conversations 64 --turns 8]`; writes
`benchmarks/results/kv-tiers.{md,json}`.
"""

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.workloads import load_tokenizer, synthetic_text
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.host_isa import host_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUESTION_TOKENS, ANSWER_TOKENS = 48, 32
SETUPS = ("tiers off", "host tier", "host + disk")


def conversation_tokens(args, tokenizer) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per conversation, its turns' questions (token ids)."""
    words = synthetic_text(200_000, seed=3).split()
    rng = random.Random(0)
    text = " ".join(words[:args.system_words])
    system = tokenizer.encode(text, add_special_tokens=False)[:args.system_tokens]

    def question() -> list[int]:
        start = rng.randrange(len(words) - 80)
        return tokenizer.encode(" ".join(words[start:start + 80]), add_special_tokens=False)[:QUESTION_TOKENS]

    return system, [[question() for _ in range(args.turns)] for _ in range(args.conversations)]


def run(engine: LLMEngine, system: list[int], questions: list[list[list[int]]], batch: int) -> dict:
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    histories = [[] for _ in questions]
    ttft, generated, started = [], 0, time.perf_counter()
    for turn in range(len(questions[0])):
        pending = list(range(len(questions)))
        while pending:
            wave, pending = pending[:batch], pending[batch:]
            wave_start = time.perf_counter()
            for c in wave:
                engine.add_request(f"c{c}t{turn}", system + histories[c] + questions[c][turn], params)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        c = int(out.request_id[1:].split("t")[0])
                        answer = out.outputs[0].token_ids
                        histories[c] += questions[c][turn] + answer
                        generated += len(answer)
                        ttft.append(out.metrics.first_token_time - max(out.metrics.arrival_time, wave_start))
    wall = time.perf_counter() - started
    stats = engine.stats()
    return {"wall_s": wall, "output_tok_s": generated / wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": statistics.quantiles(ttft, n=100)[98], "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_cache_queries": stats.prefix_cache_queries, "preemptions": stats.num_preemptions,
            "kv_tiers": stats.kv_tiers}


def prefill_s(engine: LLMEngine, prompt: list[int], rounds: int = 3) -> float:
    """The best of a few prefills of `prompt` (one token generated)."""
    times = []
    for i in range(rounds):
        started = time.perf_counter()
        engine.add_request(f"probe{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.kv_tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=16, help="requests added together (and max_num_seqs)")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="the KV pool over the working set")
    parser.add_argument("--setups", default=",".join(SETUPS), help="which setups to run (comma-separated; the report "
                        "needs them all)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.system_words = args.system_tokens
    tokenizer = load_tokenizer("smollm2")
    system, questions = conversation_tokens(args, tokenizer)
    working_set = len(system) + args.conversations * args.turns * (QUESTION_TOKENS + ANSWER_TOKENS)
    probe = LLMEngine(model="smollm2", max_num_seqs=1, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    per_token = probe.model_config.kv_bytes_per_token(probe.kv_dtype)
    probe.warm_up()
    compute_per_token = prefill_s(probe, system) / len(system)
    del probe
    pool_bytes = int(working_set * per_token * args.pool_fraction)
    tier_bytes = 2 * working_set * per_token
    results = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as host, tempfile.TemporaryDirectory() as disk:
        setups = {"tiers off": None,
                  "host tier": {"host_bytes": tier_bytes, "host_path": host},
                  "host + disk": {"host_bytes": tier_bytes // 8, "host_path": host,
                                  "disk": {"path": disk, "bytes": tier_bytes}}}
        for name, tiers in setups.items():
            if name not in args.setups.split(","):
                continue
            for folder in (host, disk):
                shutil.rmtree(folder, ignore_errors=True)
                Path(folder).mkdir(exist_ok=True)
            engine = LLMEngine(model="smollm2", max_num_seqs=args.batch, kv_cache_memory_bytes=pool_bytes,
                               max_model_len=len(system) + args.turns * (QUESTION_TOKENS + ANSWER_TOKENS) + 16,
                               **({"kv_tiers": tiers} if tiers else {}))
            engine.warm_up()
            results[name] = run(engine, system, questions, args.batch)
            print(f"[kv-tiers] {name}: {json.dumps(results[name])}", flush=True)
            del engine
    if len(results) < len(SETUPS):
        return 0
    off, host_tier = results["tiers off"], results["host tier"]
    tier = host_tier["kv_tiers"]["host"]
    load_per_token = (tier["load_s"] + host_tier["kv_tiers"]["restore_s"]) / max(1, tier["hits"] * 16)
    computed = off["prefix_cache_queries"] - off["prefix_cache_hits"]
    doc = {"commit": source_commit(), "host": host_isa().describe(), "args": vars(args) | {"out": str(args.out)},
           "working_set_tokens": working_set, "pool_bytes": pool_bytes, "results": results,
           "load_s_per_token": load_per_token, "compute_s_per_token": compute_per_token}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv-tiers.json").write_text(json.dumps(doc, indent=1))
    lines = ["# What KV tiers buy: multi-turn chat over a pool a quarter of its working set", "",
             f"`python -m kvloom.benchmarks.kv_tiers --conversations {args.conversations} --turns {args.turns}` at "
             f"{doc['commit']} on {doc['host']}: SmolLM2 (dtype auto), {args.conversations} conversations of "
             f"{args.turns} turns over a {len(system)}-token system prompt, {QUESTION_TOKENS}-token questions, "
             f"{ANSWER_TOKENS} tokens generated a turn, {args.batch} requests at once; working set {working_set} "
             f"tokens, KV pool {pool_bytes >> 20} MiB ({args.pool_fraction:.0%} of it).", "",
             "| setup | TTFT p50 (s) | TTFT p99 (s) | output tok/s | prefix hits / looked up | tier hits |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        hits = " / ".join(f"{t}: {r['kv_tiers'][t]['hits']}" for t in ("host", "disk") if r["kv_tiers"] and t in
                          r["kv_tiers"]) if r["kv_tiers"] else "-"
        lines.append(f"| {name} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['output_tok_s']:.1f} | "
                     f"{r['prefix_cache_hits']} / {r['prefix_cache_queries']} | {hits} |")
    lines += ["", f"Against tiers off: host tier TTFT p50 {off['ttft_p50_s'] / host_tier['ttft_p50_s']:.2f}x lower "
                  f"(goal 3x), p99 {off['ttft_p99_s'] / host_tier['ttft_p99_s']:.2f}x lower (goal 2x), throughput "
                  f"{host_tier['output_tok_s'] / off['output_tok_s']:.2f}x (goal 1.3x).",
              f"Loading from the host tier: {load_per_token * 1e6:.1f} us a token (read, checked and copied in), "
              f"against {compute_per_token * 1e6:.1f} us a token to compute the system prompt's prefill: "
              f"{compute_per_token / load_per_token:.0f}x (goal 20x). Tiers off computed {computed} prompt tokens "
              "in the run.", ""]
    (args.out / "kv-tiers.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
