"""xgrammar against llguidance, the measurement behind engine/structured_output.py's choice.

    python -m kvloom.benchmarks.studies.grammar_backends    # writes benchmarks/results/structured-outputs.md

For each kind of constraint, on the embedded model's tokenizer: the time to compile it (cold, one thread),
and the time to fill one row's token mask at each token of a valid output (walked token by token, each
token checked against the mask and accepted, then the end token), mean and worst over a warm second pass.
"""

import json
import statistics
import time
from pathlib import Path

from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.model.model_loader import load_tokenizer
from kvloom.kernels.host_isa import host_isa

OUT = Path(__file__).resolve().parents[1] / "results" / "structured-outputs.md"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CASES = [  # (name, kind, spec, an output that satisfies it)
    ("JSON object", "object", None, '{"city": "Paris", "population": 2161000, "capital": true}'),
    ("JSON schema", "schema", PERSON, '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}'),
    ("regex", "regex", r"\d{3}-\d{4}", "555-1234"),
    ("choice", "regex", "(positive)|(negative)|(neutral)", "neutral"),
]


def walk(tokenizer, text: str, fill, allowed, accept) -> list[float]:
    times = []
    for token in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        assert allowed(token) and accept(token), f"{text!r}: token {token} refused"
    return times


def is_set(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def xgrammar_case(tokenizer, kind: str, spec, text: str) -> tuple[float, list[float]]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    if kind == "regex":
        compiled = compiler.compile_regex(spec)
    else:
        compiled = compiler.compile_json_schema(json.dumps(spec or {"type": "object"}), any_whitespace=False)
    compile_s = time.perf_counter() - start
    masks = []
    for _ in range(2):  # the second pass is the warm one
        matcher, bitmask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, len(tokenizer))
        masks = walk(tokenizer, text, lambda: matcher.fill_next_token_bitmask(bitmask, 0),
                     lambda t: is_set(bitmask, t), matcher.accept_token)
    return compile_s, masks


def llguidance_case(tokenizer, kind: str, spec, text: str) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    start = time.perf_counter()
    grammar = (llguidance.LLMatcher.grammar_from_regex(spec) if kind == "regex" else
               llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec or {"type": "object"})))
    llguidance.LLMatcher(ll_tokenizer, grammar)
    compile_s = time.perf_counter() - start
    masks = []
    for _ in range(2):
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, len(tokenizer))
        masks = walk(tokenizer, text, lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                     lambda t: is_set(bitmask, t), matcher.consume_token)
    return compile_s, masks


def main() -> None:
    tokenizer = load_tokenizer(resolve_model_dir("smollm2"))
    lines = ["# Structured outputs: xgrammar or llguidance", "",
             f"{host_isa().describe()}; SmolLM2-135M's tokenizer ({len(tokenizer)} tokens); one thread. "
             "Compile: the constraint, cold. Mask: filling one row's token bitmask before each token of a "
             "valid output (warm pass), mean / worst. Regenerate: `python -m kvloom.benchmarks.studies.grammar_backends`.",
             "", "| constraint | xgrammar compile ms | xgrammar mask us | llguidance compile ms | llguidance mask us |",
             "|---|---|---|---|---|"]
    for name, kind, spec, text in CASES:
        cells = [name]
        for case in (xgrammar_case, llguidance_case):
            compile_s, masks = case(tokenizer, kind, spec, text)
            cells += [f"{compile_s * 1e3:.1f}", f"{statistics.mean(masks) * 1e6:.1f} / {max(masks) * 1e6:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "kvloom uses xgrammar: the mask is what every step pays for every constrained row, and xgrammar's "
              "is several times cheaper; its compile cost is paid once per distinct constraint (cached)."]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
