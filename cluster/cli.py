"""The `kvloom` command line."""

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from kvloom.engine.llm import LLM
    from kvloom.engine.sampling import SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = args.prompt or ["Explain in two sentences why the sky is blue."]
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        tokens += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")
    print(f"{len(prompts)} prompts, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tok/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom", description="kvloom LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation on one engine (no Ray)")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one example)")
    gen.add_argument("--model", default=None, help="smollm2 (default), a HF directory or a .gguf file")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
