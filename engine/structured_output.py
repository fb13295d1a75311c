"""Structured outputs: a grammar per request, applied to a step's logits as a token bitmask.

A request may ask that its output be JSON valid against a schema, any JSON object, a match of a regular
expression, one of a list of strings, or a structural tag (free text around tagged parts, each constrained: how
tool calls are constrained) (`SamplingParams.structured_outputs`). xgrammar compiles the
constraint against the model's vocabulary once (cached by constraint) and gives each request a matcher.
Every step, each constrained row's matcher fills one 32-bit word per 32 tokens, and the tokens it does not
allow go to -inf in place before sampling, greedy or not; the token chosen is then accepted into the
matcher. A matcher ends its request once it has accepted an end token in an accepting state.

Why xgrammar (measured on SmolLM2's 49k vocabulary, benchmarks/results/structured-outputs.md): it fills
a row's mask in 1-5 us on average against llguidance's 15-33 us (a step masks every constrained row, so
that is the cost that grows with the batch), and compiles these constraints in 0.3-9 ms, cheap enough
once per distinct constraint.
JSON is compact (", " and ": " between items, no free whitespace): small models otherwise tend to loop on
whitespace until max_tokens.
"""

import functools
import json
import re

import torch

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.model.fast_tokenizer import as_huggingface
from kvloom.engine.sampling import StructuredOutputs
from kvloom.engine.step_plan import device_index

COMPILED_CACHE_SIZE = 256  # constraints kept compiled (clients tend to reuse a few schemas)


class OutputGrammar:
    """One request's matcher: where its output stands in the grammar."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past an emitted token; True when the output is complete (or, for a token the mask did
        not allow, which only an all-masked row can produce, when it cannot go on)."""
        return not self.matcher.accept_token(token_id) or self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles constraints against one engine's tokenizer; xgrammar loads on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, end_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.end_token_ids = tokenizer, vocab_size, sorted(end_token_ids)
        self._compiled = functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)(self._compile)

    @functools.cached_property
    def _compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(as_huggingface(self.tokenizer), vocab_size=self.vocab_size,
                                                       stop_token_ids=self.end_token_ids)
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def matcher(self, constraint: StructuredOutputs) -> OutputGrammar:
        import xgrammar

        try:
            compiled = self._compiled(constraint.model_dump_json(exclude={"field"}))
        except ValueError as exc:
            raise InvalidRequestError(constraint.field, str(exc)) from None
        return OutputGrammar(xgrammar.GrammarMatcher(compiled))

    def _compile(self, key: str):
        constraint = StructuredOutputs.model_validate_json(key)
        try:
            if constraint.json_schema is not None:
                return self._compiler.compile_json_schema(json.dumps(constraint.json_schema), any_whitespace=False)
            if constraint.structural_tag is not None:
                return self._compiler.compile_structural_tag(constraint.structural_tag)
            if constraint.json_object:
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if constraint.regex is not None:
                return self._compiler.compile_regex(constraint.regex)
            return self._compiler.compile_regex("|".join(f"({re.escape(c)})" for c in constraint.choice))
        except (RuntimeError, ValueError) as exc:  # how xgrammar reports a schema, regex or tag it cannot use
            raise ValueError(_reason(exc)) from None


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its source-location prefix ("[time] file.cc:line: ")."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc)).strip()


def mask_disallowed(logits: torch.Tensor, grammars: list[OutputGrammar], rows: list[int]) -> None:
    """Set to -inf, in place, every token the rows' grammars do not allow next. The matchers fill a packed
    bitmask on the host (32 tokens a word); that goes to the logits' device, where it is unpacked and applied."""
    words = -(-logits.shape[-1] // 32)
    bitmask = torch.empty(len(rows), words, dtype=torch.int32, pin_memory=logits.device.type == "cuda")
    for i, grammar in enumerate(grammars):
        grammar.fill(bitmask, i)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(len(rows), -1)[:, : logits.shape[-1]]
    index = device_index(rows, logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
