"""Incremental detokenization and stop strings, O(1) tokenizer work per new token.

Decodes a short sliding window so multi-byte characters split across tokens are emitted only once
complete. While stop strings are set, the last `len(longest stop) - 1` characters are held back,
so a streamed client never sees the start of a stop string that then gets cut (with vLLM's
`include_stop_str_in_output` nothing is cut before the stop string's end, so nothing is held).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

CONTEXT_TOKENS = 6  # prompt tail used so the first output token decodes with its leading space


def token_decoder(tokenizer, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """Token ids to text, special tokens skipped unless asked for (one decoder per setting, built once): straight
    through a fast tokenizer's Rust backend, which is all transformers' `decode` calls unless the tokenizer cleans up
    spaces after it, at a quarter of the cost (SmolLM2's, six ids: 2.4 against 8.4 us, measured; the detokenizer
    decodes twice a token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


@dataclass
class IncrementalDetokenizer:
    decode: Callable[[list[int]], str]  # token_decoder's
    prompt_token_ids: list[int]
    stop: list[str]
    include_stop: bool = False  # a stop string found stays in the text (cut after it, not before)
    text: str = ""  # everything decoded so far (up to the stop string once found)
    emitted: int = 0  # characters of `text` already released to the caller
    _tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt_token_ids[-CONTEXT_TOKENS:])
        self._read_offset = len(self._tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if one now appears in the text (and `check_stop`:
        min_tokens lets stop strings count only from then on, as vLLM does)."""
        self._tokens.append(token_id)
        prefix = self.decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self.decode(self._tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        searched = len(self.text)
        self.text += delta
        for stop in self.stop if check_stop else ():
            at = self.text.find(stop, max(0, searched - len(stop) + 1))  # ending in the new text, as vLLM looks
            if at >= 0:
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                return stop
        return None

    def release(self, finished: bool) -> str:
        """New text safe to show now; everything left when finished."""
        hold = 0 if finished or not self.stop or self.include_stop else max(len(s) for s in self.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
