"""What a request asks to change in its row of logits before a token is chosen: the OpenAI penalties and
logit_bias, vLLM's repetition_penalty and min_tokens.

Built once per request, and only for a request that asks for one of them, so a batch of plain requests
pays one `is None` per row. A row that is adjusted is widened to float32 alone (the batch's logits stay
in the model's dtype); the logprobs a request gets back stay the model's own, as vLLM returns by default.
"""

from dataclasses import dataclass

import torch

from kvloom.engine.sampling import SamplingParams


@dataclass(frozen=True)
class LogitsAdjuster:
    repetition_penalty: float  # vLLM/transformers: over prompt and output tokens, divides positive logits
    presence_penalty: float  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float  # OpenAI: subtracted per occurrence in the output
    bias: tuple[tuple[int, float], ...]  # logit_bias: (token id, value added)
    min_tokens: int
    end_token_ids: tuple[int, ...]  # banned while the output is shorter than min_tokens

    @classmethod
    def for_request(cls, params: SamplingParams, eos_token_ids: set[int]) -> "LogitsAdjuster | None":
        """None when the request asks for nothing this class does."""
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        adjuster = cls(
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
            tuple(sorted(params.logit_bias.items())), params.min_tokens, tuple(sorted(ends)),
        )
        return adjuster if adjuster.active else None

    @property
    def active(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.bias or (self.min_tokens and self.end_token_ids))

    def apply(self, logits: torch.Tensor, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
        """`logits`: one row, float32, changed in place and returned; `token_ids`: prompt then output."""
        output = token_ids[num_prompt_tokens:]
        if self.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / self.repetition_penalty, values * self.repetition_penalty)
        if (self.presence_penalty or self.frequency_penalty) and output:
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1])
            logits -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
        if self.bias:
            ids, values = zip(*self.bias)
            logits[list(ids)] += torch.tensor(values, dtype=logits.dtype)
        if len(output) < self.min_tokens and self.end_token_ids:
            logits[list(self.end_token_ids)] = float("-inf")
        return logits
