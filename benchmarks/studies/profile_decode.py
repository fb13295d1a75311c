"""Where a decode step's time goes: step times and a torch.profiler table at a few batch sizes.

    python -m kvloom.benchmarks.studies.profile_decode --dtype bfloat16 --batches 1,16,64
    python -m kvloom.benchmarks.studies.profile_decode --dtype bfloat16 --quantization gguf --batches 1

Each batch is that many requests with 256-token prompts, prefilled first; then decode steps are timed
(median and best of 10) and 5 more are profiled. Results in benchmarks/results/decode-profile.md.
"""

import argparse
import statistics
import time

import numpy as np
from torch.profiler import ProfilerActivity, profile

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.item_pool import intra_op_threads

PROMPT_TOKENS = 256


def fill(engine: LLMEngine, batch: int, tag: str, max_tokens: int = 40) -> None:
    """`batch` running requests, every prompt computed, so the next steps are pure decode."""
    for i in range(batch):
        prompt = np.random.default_rng(i).integers(100, 40_000, PROMPT_TOKENS).tolist()
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.stats().num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                            for r in engine.scheduler.running):
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="gguf or gguf-int8: run the file's blocks as stored")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rows", type=int, default=12, help="profiler table rows")
    args = parser.parse_args()
    engine = LLMEngine(model=args.model, dtype=args.dtype, max_model_len=2048, quantization=args.quantization)
    for batch in (int(b) for b in args.batches.split(",")):
        fill(engine, batch, f"b{batch}")
        for _ in range(3):
            engine.step()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        print(f"## {engine.dtype} decode, batch {batch}, context ~{PROMPT_TOKENS + 13}: step median "
              f"{statistics.median(times) * 1e3:.1f} ms, best {min(times) * 1e3:.1f} ms ({intra_op_threads()} threads)")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
