"""What a request asks to change in its row of logits before a token is chosen: the OpenAI penalties and
logit_bias, vLLM's repetition_penalty, min_tokens, bad_words and allowed_token_ids.

Built once per request, and only for a request that asks for one of them, so a batch of plain requests
pays one `is None` per row. The sampler hands the rows that are adjusted (widened to float32; the batch's
logits stay in the model's dtype) to `adjust_rows`, which changes them all at once; the logprobs a request
gets back stay the model's own, as vLLM returns by default.
"""

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvloom.engine.sampling import SamplingParams
from kvloom.engine.step_plan import to_device


@dataclass(frozen=True)
class LogitsAdjuster:
    repetition_penalty: float  # vLLM/transformers: over prompt and output tokens, divides positive logits
    presence_penalty: float  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float  # OpenAI: subtracted per occurrence in the output
    bias: tuple[tuple[int, float], ...]  # logit_bias: (token id, value added)
    min_tokens: int
    end_token_ids: tuple[int, ...]  # banned while the output is shorter than min_tokens
    # vLLM's bad_words: each word's token sequences; a sequence's last token is banned where the output ends with
    # the rest of it (a one-token word: always)
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: every other token banned
    _banned_masks: dict = field(default_factory=dict, compare=False, repr=False)  # see `banned_by_allowed`

    @classmethod
    def for_request(cls, params: SamplingParams, eos_token_ids: set[int],
                    bad_words: tuple[tuple[int, ...], ...] = ()) -> "LogitsAdjuster | None":
        """None when the request asks for nothing this class does. `bad_words`: the request's bad words as token
        sequences (InputProcessor.bad_word_sequences: only it has the tokenizer)."""
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        allowed = params.allowed_token_ids
        adjuster = cls(
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
            tuple(sorted(params.logit_bias.items())), params.min_tokens, tuple(sorted(ends)), bad_words,
            None if allowed is None else tuple(sorted(set(allowed))),
        )
        return adjuster if adjuster.active else None

    def banned_by_allowed(self, vocab: int, device: torch.device) -> torch.Tensor:
        """True for each token allowed_token_ids leaves out: bool [vocab], built on `device` once per request, so a
        long list costs its steps nothing more than a short one."""
        if device not in self._banned_masks:
            mask = torch.ones(vocab, dtype=torch.bool)
            mask[list(self.allowed_token_ids)] = False
            self._banned_masks[device] = to_device(mask, device)
        return self._banned_masks[device]

    @property
    def active(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.bias or (self.min_tokens and self.end_token_ids) or self.bad_words
                    or self.allowed_token_ids is not None)


def adjust_rows(logits: torch.Tensor, requests: list) -> None:
    """Apply each request's adjuster (if any) to its row of float32 `logits` [rows, vocab], in place, every row
    at once: each kind of change touches only the (row, token) pairs it changes, sent to the device as one
    tensor. `requests`: engine Requests (their adjuster, token ids and prompt length)."""
    device = logits.device
    adjusted = [(row, r.logits_adjuster, r.token_ids, r.num_prompt_tokens)
                for row, r in enumerate(requests) if r.logits_adjuster is not None]
    if not adjusted:
        return
    repeated = [(row, token, a.repetition_penalty) for row, a, tokens, _ in adjusted
                if a.repetition_penalty != 1.0 for token in sorted(set(tokens))]
    if repeated:
        rows, tokens, penalty = _columns(repeated, device)
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
    penalties = [(row, token, a.frequency_penalty * count + a.presence_penalty)
                 for row, a, tokens, prompt in adjusted if a.presence_penalty or a.frequency_penalty
                 for token, count in Counter(tokens[prompt:]).items()]
    if penalties:  # OpenAI: frequency per occurrence in the output, presence once
        rows, tokens, values = _columns(penalties, device)
        logits.index_put_((rows, tokens), -values, accumulate=True)
    biased = [(row, token, value) for row, a, _, _ in adjusted for token, value in a.bias]
    if biased:
        rows, tokens, values = _columns(biased, device)
        logits.index_put_((rows, tokens), values, accumulate=True)
    banned = [(row, token) for row, a, tokens, prompt in adjusted
              if len(tokens) - prompt < a.min_tokens for token in a.end_token_ids]
    banned += [(row, word[-1]) for row, a, tokens, prompt in adjusted for word in a.bad_words
               if _completes(tokens, prompt, word)]
    if banned:
        rows, tokens = _columns(banned, device)
        logits[rows, tokens] = float("-inf")
    limited = [(row, a) for row, a, _, _ in adjusted if a.allowed_token_ids is not None]
    if limited:
        rows = to_device(torch.tensor([row for row, _ in limited]), device)
        banned_rows = torch.stack([a.banned_by_allowed(logits.shape[-1], device) for _, a in limited])
        logits[rows] = logits[rows].masked_fill(banned_rows, float("-inf"))


def _completes(tokens: list[int], prompt: int, word: tuple[int, ...]) -> bool:
    """Whether the output (`tokens` past the first `prompt`) ends with all of `word` but its last token."""
    start = len(tokens) - len(word) + 1
    return start >= prompt and tuple(tokens[start:]) == word[:-1]


def _columns(rows: list[tuple], device: torch.device) -> list[torch.Tensor]:
    """Columns of a list of tuples as device tensors (ints as int64, floats as float32), one copy."""
    table = to_device(torch.tensor(rows, dtype=torch.float64), device)
    return [column.long() if isinstance(value, int) else column.float() for column, value in zip(table.T, rows[0])]
