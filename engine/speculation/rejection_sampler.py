"""Verification of drafted tokens: which of them the target model keeps, and the token after them.

A request with k drafts has k + 1 rows of target logits: row i scores the position of draft i (the last
row, the position after all of them). Greedy requests keep the drafts equal to the target's argmax and
then the argmax where they first differ (or after the last), so the output is token for token what
decoding one token a step gives. Sampled requests use rejection sampling (Leviathan et al., 2023): draft
i is kept with probability min(1, p(d)/q(d)), where p is the target's distribution (temperature, top-k,
top-p applied) and q the draft's; the first rejected position draws from norm(max(0, p - q)), and when all
are kept the last row draws a bonus token from p. Each position's token is then distributed exactly as
p: a proposer can cost speed, never change what is sampled. Drafts without probabilities (prompt lookup)
have a point mass q on the drafted token.

Every row of the step is judged at once on the device, as in vLLM's v1 rejection sampler: each row gets the
target's token there (the argmax, or a draw from the residual) and whether its draft is kept; a request outputs
its rows' tokens up to and including its first row whose draft is not kept, and the step's tokens come to the host
in one copy. The uniforms are counter-based (`counter_draws`), computed on the host: draft i's acceptance test and
the token drawn at its position use that position's own lanes, so a seeded request's draws depend on neither how
many drafts came before nor its neighbours.
"""

import itertools
from dataclasses import dataclass

import torch

from kvloom.engine.counter_draws import Lane, uniform
from kvloom.engine.request import Request
from kvloom.engine.sampler import (DrawKnobs, SampledToken, draw_from, filtered_logits, logprobs_of, rows_per_pass,
                                   sample_tokens)
from kvloom.engine.step_plan import device_index, to_device

PLACEHOLDER = -1  # a request's last row's draft (it has none), and the token of a row a request does not output


@dataclass
class StepRows:
    """The step's rows as the host knows them: request i's are starts[i]..starts[i + 1] - 1."""
    starts: list[int]
    drafts: list[int]  # per row, the token drafted for its position (PLACEHOLDER on a request's last row)

    @classmethod
    def of(cls, requests: list[Request]) -> "StepRows":
        return cls(list(itertools.accumulate((len(r.spec_token_ids) + 1 for r in requests), initial=0)),
                   [t for r in requests for t in (*r.spec_token_ids, PLACEHOLDER)])

    def rows(self, requests: list[int]) -> list[int]:
        return [row for i in requests for row in range(self.starts[i], self.starts[i + 1])]

    def first_rows(self) -> list[int]:
        """Per row, its request's first row."""
        return [start for start, end in zip(self.starts, self.starts[1:]) for _ in range(end - start)]


def verify(logits: torch.Tensor, requests: list[Request]) -> list[list[SampledToken]]:
    """`logits`: len(spec_token_ids) + 1 rows per request, in request order; returns the tokens each keeps."""
    layout, device = StepRows.of(requests), logits.device
    host = to_device(torch.tensor([layout.drafts, layout.first_rows()], dtype=torch.long), device)
    drafts, first_rows = host[0], host[1]
    targets = torch.empty_like(drafts)  # per row, the target's token at its position
    kept = torch.empty_like(drafts, dtype=torch.bool)  # per row, whether its draft is kept
    drawing = [i for i, r in enumerate(requests) if r.spec_token_ids and not r.sampling_params.greedy]
    plain = [i for i, r in enumerate(requests) if not r.spec_token_ids or r.sampling_params.greedy]
    for group, judge in ((plain, _judge_plain), (drawing, _judge_drawing)):
        if group:
            index = device_index(layout.rows(group), device)
            group_targets, group_kept = judge(logits, index, [requests[i] for i in group],
                                              drafts.index_select(0, index))
            targets.index_copy_(0, index, group_targets)
            kept.index_copy_(0, index, group_kept)
    refused = (~kept).long()
    refused_before = refused.cumsum(0) - refused  # over the step: those before a request's first row are not its own
    out = torch.where(kept, drafts, targets).masked_fill(refused_before > refused_before[first_rows], PLACEHOLDER)
    per_row = out.tolist()  # the step's one device-to-host copy
    tokens = [per_row[start:end] for start, end in zip(layout.starts, layout.starts[1:])]
    return _with_logprobs(logits, requests, layout.starts, [t[: t.index(PLACEHOLDER)] if PLACEHOLDER in t else t
                                                            for t in tokens])


def _judge_plain(logits: torch.Tensor, index: torch.Tensor, requests: list[Request], drafts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows at `index` drawn as in a plain step (a greedy request's: the argmax), from a copy (the sampler
    masks its rows in place; the logprobs read the model's own); a draft is kept where it is that token."""
    rows = [r for r in requests for _ in range(len(r.spec_token_ids) + 1)]
    tokens = sample_tokens(logits.index_select(0, index), rows)
    return tokens, tokens == drafts


def _judge_drawing(logits: torch.Tensor, index: torch.Tensor, requests: list[Request], drafts: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows at `index`, of sampled requests with drafts, a few at a time on CPU (`rows_per_pass`). There, where
    reading a result costs no transfer, rows after one whose draft is refused are skipped: nothing of them is output."""
    rows = [(i, r, j) for i, r in enumerate(requests) for j in range(len(r.spec_token_ids) + 1)]
    knobs = DrawKnobs.of([r.sampling_params for _, r, _ in rows], logits.shape[-1], logits.device,
                         [uniform(r.draw_seed, r.num_output_tokens + j, Lane.TOKEN) for _, r, j in rows])
    # float64: u * q as exact as on the host; point: 1 on a draft without a distribution (a point mass q)
    host = to_device(torch.tensor([[uniform(r.draw_seed, r.num_output_tokens + j, Lane.ACCEPT),
                                    float(r.spec_probs is None and j < len(r.spec_token_ids))] for _, r, j in rows],
                                  dtype=torch.float64), logits.device)
    u_accept, point = host[:, 0], host[:, 1].float()
    step, skips, refused = rows_per_pass(logits), reads_are_free(logits.device), set()
    tokens, kept = [], []
    for start in range(0, len(rows), step):
        end = start + step
        owners = [i for i, _, _ in rows[start:end]]
        if skips and refused.issuperset(owners):
            tokens.append(torch.zeros(len(owners), dtype=torch.long))
            kept.append(torch.zeros(len(owners), dtype=torch.bool))
            continue
        part, draft = knobs.part(start, end), drafts[start:end].clamp_min(0).unsqueeze(1)
        p = filtered_logits(logits.index_select(0, index[start:end]).float(), part).softmax(-1)
        q = _draft_probs(rows[start:end], logits.shape[-1], logits.device)
        q.scatter_add_(1, draft, point[start:end, None])  # the point masses
        p_draft, q_draft = p.gather(1, draft).squeeze(1), q.gather(1, draft).squeeze(1)
        # draft d is kept when u * q(d) < p(d) (u < p/q without dividing by 0)
        kept.append((drafts[start:end] != PLACEHOLDER) & (u_accept[start:end] * q_draft.double() < p_draft.double()))
        # the token drawn from the residual max(0, p - q), or from p where nothing remains of it (a request's last
        # row, where q is 0: its bonus token from p)
        residual = (p - q).clamp_min_(0)
        tokens.append(draw_from(torch.where(residual.sum(-1, keepdim=True) > 0, residual, p), part.uniform))
        if skips:
            refused.update(i for i, k in zip(owners, kept[-1].tolist()) if not k)
    return torch.cat(tokens), torch.cat(kept)


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a result on the host costs no device-to-host copy (CPU)."""
    return device.type == "cpu"


def _draft_probs(rows: list[tuple[int, Request, int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The draft model's distributions of these rows (request index, request, draft position), float32
    [rows, vocab]; 0 where there is none (a point mass, or a request's last row)."""
    modelled = [r.spec_probs[j] if r.spec_probs is not None and j < len(r.spec_token_ids) else None
                for _, r, j in rows]
    if all(q is None for q in modelled):
        return torch.zeros(len(rows), vocab, device=device)
    zero = torch.zeros(vocab, device=device)
    return torch.stack([zero if q is None else q.float() for q in modelled])


def _with_logprobs(logits: torch.Tensor, requests: list[Request], starts: list[int], kept: list[list[int]]
                   ) -> list[list[SampledToken]]:
    """The kept tokens, with the logprobs their requests asked for (the model's own, at the tokens' rows)."""
    wanting = [(i, j) for i, r in enumerate(requests) if r.sampling_params.logprobs is not None
               for j in range(len(kept[i]))]
    found = {}
    if wanting:
        raw = logits.index_select(0, device_index([starts[i] + j for i, j in wanting], logits.device))
        found = dict(zip(wanting, logprobs_of(raw.float().log_softmax(-1), [kept[i][j] for i, j in wanting],
                                              [requests[i].sampling_params.logprobs for i, _ in wanting])))
    return [[SampledToken(t, found.get((i, j))) for j, t in enumerate(tokens)] for i, tokens in enumerate(kept)]
