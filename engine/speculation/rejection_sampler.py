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
"""

import torch

from kvloom.engine.request import Request
from kvloom.engine.counter_draws import Lane, uniform
from kvloom.engine.sampler import SampledToken, draw, logprobs_of, sample, sampling_probs


def verify(logits: torch.Tensor, requests: list[Request]) -> list[list[SampledToken]]:
    """`logits`: len(spec_token_ids) + 1 rows per request, in request order; returns the tokens each keeps."""
    counts = [len(r.spec_token_ids) + 1 for r in requests]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    # rows drawn one by one as in a plain step: requests without drafts, and greedy ones (argmax per row)
    plain = [i for i, r in enumerate(requests) if counts[i] == 1 or r.sampling_params.greedy]
    rows = [starts[i] + j for i in plain for j in range(counts[i])]
    drawn = iter(sample(logits[rows], [requests[i] for i in plain for _ in range(counts[i])]))
    per_row = {i: [next(drawn) for _ in range(counts[i])] for i in plain}
    kept = []
    for i, request in enumerate(requests):
        if i in per_row:
            kept.append(_longest_agreeing_prefix(per_row[i], request.spec_token_ids))
        else:
            kept.append(_rejection_sample(logits[starts[i] : starts[i] + counts[i]], request))
    return kept


def _longest_agreeing_prefix(target: list[SampledToken], drafts: list[int]) -> list[SampledToken]:
    accepted = 0
    while accepted < len(drafts) and target[accepted].token_id == drafts[accepted]:
        accepted += 1
    return target[: accepted + 1]


def _rejection_sample(logits: torch.Tensor, request: Request) -> list[SampledToken]:
    """Draft i's acceptance test and the token drawn at its position use that position's counter-based uniforms
    (their own lanes), so a seeded request's draws do not depend on how many drafts came before."""
    params, drafts, draft_probs = request.sampling_params, request.spec_token_ids, request.spec_probs
    first, seed = request.num_output_tokens, request.draw_seed
    raw = logits.float()
    kept: list[int] = []
    for i, token in enumerate(drafts):
        p = sampling_probs(raw[i], params)
        q_token = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        if uniform(seed, first + i, Lane.ACCEPT) * q_token < float(p[token]):  # u < p/q without dividing by 0
            kept.append(token)
            continue
        if draft_probs is not None:
            residual = (p - draft_probs[i]).clamp_min_(0)
        else:
            residual = p.clone()
            residual[token] = 0
        kept.append(draw(residual if float(residual.sum()) > 0 else p, uniform(seed, first + i, Lane.TOKEN)))
        break
    else:
        kept.append(draw(sampling_probs(raw[len(drafts)], params), uniform(seed, first + len(drafts), Lane.TOKEN)))
    if params.logprobs is None:
        return [SampledToken(t, None) for t in kept]
    logprobs = logprobs_of(raw[: len(kept)].log_softmax(-1), kept, [params.logprobs] * len(kept))
    return [SampledToken(t, lp) for t, lp in zip(kept, logprobs)]
