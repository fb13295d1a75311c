"""Prompt logprobs (vLLM's `prompt_logprobs`, and OpenAI's `echo` with `logprobs`): each prompt token's logprob
under the model given the tokens before it, with its top alternatives.

A step computing prompt positions of a request that asks keeps those rows' hidden states to the LM head as well
as the sample rows (the row at position p gives the logits that predict token p + 1); `take` records them on the
request and hands the sample rows' logits on to sampling. Requests that do not ask pay nothing: their steps keep
the sample rows only. Such a request computes its whole prompt (it takes no prefix-cache hit, as vLLM's does not):
a cached block has no logits. Positions are recorded by index, so a preempted request's recomputation, or a
prompt computed in chunks, gives each position once, as (its token's rank, {token: logprob} with the token first
and then its top alternatives). The first prompt token has none (nothing precedes it)."""

from dataclasses import dataclass

import torch

from kvloom.engine.request import Request

ROWS_AT_A_TIME = 64


def wants_prompt_logprobs(request: Request) -> bool:
    return request.sampling_params.prompt_logprobs is not None


def prompt_rows(request: Request, first_row: int, start: int, end: int) -> list[tuple[int, Request, int]]:
    """(row, request, position of the token it predicts) for a request computing positions start..end-1 from
    `first_row` on: every row whose next token is a prompt token."""
    if not wants_prompt_logprobs(request):
        return []
    return [(first_row + p - start, request, p + 1) for p in range(start, min(end, request.num_prompt_tokens - 1))]


@dataclass(frozen=True)
class PromptLogprobRows:
    kept_rows: list[int]  # the sample rows and the prompt rows, ascending: what the LM head computes
    sample_index: torch.Tensor  # where the sample rows sit among them
    prompt_index: torch.Tensor
    targets: list[tuple[Request, int]]  # per prompt row: its request and the position of the token it predicts

    @staticmethod
    def plan(sample_rows: list[int], rows: list[tuple[int, Request, int]], device) -> "PromptLogprobRows | None":
        if not rows:
            return None
        kept = sorted([*sample_rows, *(row for row, _, _ in rows)])
        where = {row: i for i, row in enumerate(kept)}
        return PromptLogprobRows(kept, torch.tensor([where[r] for r in sample_rows], dtype=torch.long, device=device),
                                 torch.tensor([where[row] for row, _, _ in rows], dtype=torch.long, device=device),
                                 [(request, position) for _, request, position in rows])

    def take(self, logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt rows' logprobs on their requests; the sample rows' logits, in sample order. A few rows
        at a time, each widened to float32 alone: logprob = logit - logsumexp (a prompt's rows times the vocabulary
        would otherwise be several float32 copies of gigabytes)."""
        tokens = torch.tensor([r.token_ids[p] for r, p in self.targets], device=logits.device)
        num_top = max(r.sampling_params.prompt_logprobs for r, _ in self.targets)
        for start in range(0, len(self.targets), ROWS_AT_A_TIME):
            block = logits.index_select(0, self.prompt_index[start:start + ROWS_AT_A_TIME]).float()
            norm = block.logsumexp(-1, keepdim=True)
            chosen = block.gather(1, tokens[start:start + ROWS_AT_A_TIME].unsqueeze(1))
            ranks = ((block > chosen).sum(1) + 1).tolist()  # 1: the most likely token
            chosen = (chosen - norm).squeeze(1).tolist()
            top = (block.max(-1, keepdim=True) if num_top == 1 else block.topk(num_top)) if num_top else None
            values = (top.values - norm).tolist() if top is not None else None
            indices = top.indices.tolist() if top is not None else None
            for i, (request, position) in enumerate(self.targets[start:start + ROWS_AT_A_TIME]):
                entry = {request.token_ids[position]: chosen[i]}  # the token first, then its top alternatives
                wanted = request.sampling_params.prompt_logprobs
                for value, alternative in zip(values[i][:wanted] if values else (), indices[i][:wanted] if indices else ()):
                    entry.setdefault(alternative, value)
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None] * request.num_prompt_tokens
                request.prompt_logprobs[position] = (ranks[i], entry)
        return logits.index_select(0, self.sample_index)
