"""vLLM's offline `LLM` on a kvloom workload, run inside vLLM's own virtual environment.

Standalone on purpose (it imports vLLM, never kvloom: the two pin different torch and transformers).
Reads the workload's JSONL (token-id prompts), generates greedily with EOS ignored, and writes one JSON
document: wall time of `generate`, every request's generated token ids and, from vLLM's own per-request
stats, when its first and last tokens came (engine-core monotonic clock, the same as this process's), and
vLLM's speculative-decoding counters when `--speculative-config` (vLLM's JSON) is given. With `--lora` (JSON:
adapters by name, max_loras, max_cpu_loras, max_lora_rank) each request runs under the adapter its `lora` names.
`--compilation-config` (vLLM's JSON, e.g. '{"mode": 0}') overrides the CPU platform's default compilation, for
checking which level is vLLM's best on a host (docs/performance.md, session 52).
    python vllm_offline.py WORKLOAD.jsonl MODEL_DIR OUT.json --dtype bfloat16 --max-num-seqs 64 ...

`add_engine_arguments` and `engine` are the engine settings every vLLM driver here shares (vllm_multiturn.py).
"""

import argparse
import json
import time

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's knobs, as kvloom's BenchSettings set them; `--kv-cache-memory-bytes` in bytes (vLLM 0.32's
    `VLLM_CPU_KVCACHE_SPACE` takes whole GiB only)."""
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")


def engine(args: argparse.Namespace, **knobs):
    """vLLM's `LLM` with the shared settings (seed 0, its stats on) and any driver-specific `knobs`."""
    from vllm import LLM

    return LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=not args.no_prefix_caching,
               seed=0, disable_log_stats=False, **knobs)


def spec_decode_counters(metrics) -> dict:
    """vLLM's speculative-decoding counters (and per-position acceptance) from `LLM.get_metrics()`."""
    found = {}
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            found[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["num_accepted_tokens_per_pos"] = [int(v) for v in metric.values]
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("model")
    parser.add_argument("out")
    add_engine_arguments(parser)
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    parser.add_argument("--lora", type=json.loads, default=None)
    parser.add_argument("--compilation-config", type=json.loads, default=None)
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    with open(args.workload) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    lora = args.lora or {}
    lora_knobs = {"enable_lora": True, "max_loras": lora["max_loras"], "max_cpu_loras": lora["max_cpu_loras"],
                  "max_lora_rank": lora["max_lora_rank"]} if lora else {}
    ids = {name: i + 1 for i, name in enumerate(sorted(lora.get("adapters", {})))}
    adapters = [LoRARequest(r["lora"], ids[r["lora"]], lora["adapters"][r["lora"]]) if r.get("lora") else None
                for r in requests]
    load_start = time.perf_counter()
    compilation = {"compilation_config": args.compilation_config} if args.compilation_config else {}
    llm = engine(args, speculative_config=args.speculative_config, **lora_knobs, **compilation)
    load_s = time.perf_counter() - load_start
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    start = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters if lora else None)
    wall = time.monotonic() - start
    result = {"load_s": load_s, "wall_s": wall,
              "outputs": {r["request_id"]: list(o.outputs[0].token_ids) for r, o in zip(requests, outputs)},
              "times": {r["request_id"]: [o.metrics.first_token_ts - start, o.metrics.last_token_ts - start]
                        for r, o in zip(requests, outputs) if o.metrics is not None},
              "spec_decode": spec_decode_counters(llm.get_metrics()) if args.speculative_config else None}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes that re-import this file
    main()
