"""vLLM's offline `LLM` on kvloom's multi-turn chat (benchmarks/kv_tiers.py, scenario (a)), run inside vLLM's own
virtual environment, with the engine settings of vllm_offline.py.

Reads the conversations (JSON: `system` and per conversation its turns' `questions`, token ids; `batch`,
`answer_tokens`) and, after a warm-up request like kvloom's (`LLMEngine.warm_up`: 32 tokens of one id, 2
generated), runs them as kvloom's run does: every conversation's turn t, `batch` at a time in one `generate`, then
turn t + 1; a turn's prompt is the system prompt, the conversation's history (its earlier questions and vLLM's own
answers: a chat's history is what the model said) and the new question. Greedy, EOS ignored. Writes one JSON
document: every request's TTFT from its wave's start (vLLM's own per-request stats, engine-core monotonic clock),
the tokens generated, the wall time of all waves, vLLM's prefix-cache counters, its version, KV block size and
compilation mode.
    python vllm_multiturn.py CONVERSATIONS.json MODEL_DIR OUT.json --dtype bfloat16 --max-num-seqs 16 ...
"""

import argparse
import json
import time

from vllm_offline import add_engine_arguments, engine


def counters(metrics) -> dict[str, int]:
    """vLLM's prefix-cache counters (its pool's and, with a KV connector, the external ones) and preemptions."""
    return {m.name.removeprefix("vllm:"): int(m.value) for m in metrics
            if ("prefix_cache" in m.name or m.name == "vllm:num_preemptions") and hasattr(m, "value")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("conversations")
    parser.add_argument("model")
    parser.add_argument("out")
    add_engine_arguments(parser)
    args = parser.parse_args()

    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.conversations) as f:
        chat = json.load(f)
    system, questions, batch = chat["system"], chat["questions"], chat["batch"]
    params = SamplingParams(temperature=0, max_tokens=chat["answer_tokens"], ignore_eos=True)
    load_start = time.perf_counter()
    llm = engine(args)
    llm.generate([TokensPrompt(prompt_token_ids=[1000] * 32)], SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    load_s = time.perf_counter() - load_start
    histories: list[list[int]] = [[] for _ in questions]
    ttft, generated, started = {}, 0, time.monotonic()
    for turn in range(len(questions[0])):
        for first in range(0, len(questions), batch):
            wave = range(first, min(first + batch, len(questions)))
            prompts = [TokensPrompt(prompt_token_ids=system + histories[c] + questions[c][turn]) for c in wave]
            wave_start = time.monotonic()
            for c, output in zip(wave, llm.generate(prompts, params, use_tqdm=False)):
                answer = list(output.outputs[0].token_ids)
                histories[c] += questions[c][turn] + answer
                generated += len(answer)
                ttft[f"c{c}t{turn}"] = output.metrics.first_token_ts - wave_start
    config = llm.llm_engine.vllm_config
    result = {"load_s": load_s, "wall_s": time.monotonic() - started, "generated": generated, "ttft": ttft,
              "counters": counters(llm.get_metrics()), "version": vllm.__version__,
              "block_size": config.cache_config.block_size, "compilation": config.compilation_config.mode.name}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes that re-import this file
    main()
