"""Token sampling for the rows of one step, batched on the device the logits are on.

Every row's argmax comes first (greedy rows are done). Rows that draw, or that a penalty, logit_bias or
min_tokens adjusts, are widened to float32 together, adjusted together, filtered together (temperature,
then top-k and top-p, vLLM's order; rows that filter nothing skip the sort) and drawn together by inverse
CDF from counter-based uniforms (`counter_draws`): a request's i-th token draws from (seed, i) whatever its
neighbours; the uniforms are computed on the host and travel with the rows' knobs, one packed tensor. On an
accelerator the rows go in one pass; on CPU in groups that keep each pass in cache (docs/performance.md has
the measurement). The step's token ids come back in one device-to-host copy (the logprobs a request asked
for in one more). Rows with a structured-output grammar are masked first; logprobs stay the model's own.
"""

from dataclasses import dataclass

import torch

from kvloom.engine.counter_draws import Lane, uniform
from kvloom.engine.logits_processors import adjust_rows
from kvloom.engine.request import Request
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.step_plan import device_index, to_device
from kvloom.engine.structured_output import mask_disallowed
from kvloom.kernels.fused_ops import argmax_rows

NO_TOP_P = 2.0  # a top_p no cumulative mass reaches: the row keeps every token
CPU_PASS_ELEMENTS = 1 << 16  # on CPU the drawing rows go in groups this big: a group's passes stay in cache


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # the chosen token first, then the top alternatives


@dataclass
class DrawKnobs:
    """The knobs of the rows that draw, as device tensors built from one packed host tensor."""
    temperature: torch.Tensor  # float32 [rows]
    top_k: torch.Tensor  # int64 [rows]; the vocabulary size where top-k is off
    top_p: torch.Tensor  # float32 [rows]; NO_TOP_P where top-p is off
    uniform: torch.Tensor  # float32 [rows]: the row's counter-based draw (0 where none was asked)
    # known on the host, so nothing waits on the device to find them
    filtering: list[int]  # rows whose top-k or top-p may drop a token
    largest_top_k: int  # the largest top-k among them (the vocabulary size if one has none)
    top_p_rows: bool  # whether one of them has a top-p (a full sort) or top-k alone (a partial one) suffices

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device,
           uniforms: list[float] | None = None) -> "DrawKnobs":
        """`uniforms`: per row, its draw (None: distributions only)."""
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        rows = [[p.temperature or 1.0, k, p.top_p if p.top_p < 1.0 else NO_TOP_P, u]
                for p, k, u in zip(params, top_k, uniforms or [0.0] * len(params))]
        packed = to_device(torch.tensor(rows, dtype=torch.float64), device)  # exact for the knobs and uniforms
        filtering = [row for row, (p, k) in enumerate(zip(params, top_k)) if k < vocab or p.top_p < 1.0]
        return cls(packed[:, 0].float(), packed[:, 1].long(), packed[:, 2].float(), packed[:, 3].float(), filtering,
                   max((top_k[row] for row in filtering), default=vocab),
                   any(params[row].top_p < 1.0 for row in filtering))

    def part(self, start: int, end: int) -> "DrawKnobs":
        """Rows start..end-1 (views; the top-k and top-p bounds stay the whole batch's)."""
        return DrawKnobs(self.temperature[start:end], self.top_k[start:end], self.top_p[start:end],
                         self.uniform[start:end], [row - start for row in self.filtering if start <= row < end],
                         self.largest_top_k, self.top_p_rows)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, largest_top_k: int,
                 top_p_rows: bool) -> torch.Tensor:
    """Each row with only its top-k tokens (ties with the k-th kept), then the fewest whose mass reaches top_p
    (the first always kept); the rest -inf. Without top-p rows a partial top-k replaces the sort."""
    if not top_p_rows:
        kth = logits.topk(largest_top_k).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    ordered, order = logits.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (top_k - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    ordered = ordered.masked_fill((probs.cumsum(-1) - probs) >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def filtered_logits(logits: torch.Tensor, knobs: DrawKnobs) -> torch.Tensor:
    """float32 logits [rows, vocab] at their rows' temperature, top-k and top-p applied (-inf outside); new."""
    scaled = logits / knobs.temperature.unsqueeze(1)
    bounds = (knobs.largest_top_k, knobs.top_p_rows)
    if len(knobs.filtering) == len(scaled):
        return _top_k_top_p(scaled, knobs.top_k, knobs.top_p, *bounds)
    if knobs.filtering:
        rows = device_index(knobs.filtering, logits.device)
        scaled[rows] = _top_k_top_p(scaled[rows], knobs.top_k[rows], knobs.top_p[rows], *bounds)
    return scaled


def sampling_probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's distribution (speculative decoding's per-request paths): float32 logits [vocab]."""
    knobs = DrawKnobs.of([params], row_logits.shape[-1], row_logits.device)
    return filtered_logits(row_logits.unsqueeze(0), knobs)[0].softmax(-1)


def draw_from(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws, one uniform per row: [rows, vocab] non-negative weights (probabilities, or not yet
    normalised), [rows] uniforms in [0, 1). The first entry whose cumulative weight exceeds u times the row's
    total: never a zero-weight token (its cdf is flat)."""
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picked.clamp_max(weights.shape[-1] - 1)


def draw(probs: torch.Tensor, u: float) -> int:
    """One row's draw: [vocab] probabilities and a uniform in [0, 1)."""
    return int(draw_from(probs.unsqueeze(0), to_device(torch.tensor([u]), probs.device))[0])


def _draw_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """A counter-based draw for each float32 row (adjusted already). On CPU the rows go a few at a time, each
    group through all its passes while it is in cache."""
    uniforms = [uniform(r.draw_seed, r.num_output_tokens, Lane.TOKEN) for r in requests]
    knobs = DrawKnobs.of([r.sampling_params for r in requests], logits.shape[-1], logits.device, uniforms)
    per_pass = rows_per_pass(logits)
    drawn = []
    for start in range(0, len(requests), per_pass):
        part = knobs.part(start, start + per_pass)
        scaled = filtered_logits(logits[start : start + per_pass], part)
        drawn.append(draw_from(scaled.softmax(-1), part.uniform))
    return torch.cat(drawn)


def rows_per_pass(logits: torch.Tensor) -> int:
    """How many rows of `logits` [rows, vocab] one pass of per-row work takes: all on an accelerator, on CPU a
    group that stays in cache."""
    return len(logits) if logits.device.type != "cpu" else max(1, CPU_PASS_ELEMENTS // logits.shape[-1])


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The listed rows widened to float32: the logits themselves where they are all rows and float32 already."""
    if len(rows) == logits.shape[0]:
        return logits.float()
    return logits.index_select(0, device_index(rows, logits.device)).float()


def _put(tokens: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    return tokens.index_copy(0, device_index(rows, tokens.device), values)


def sample(logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
    """`logits` is [len(requests), vocab] in the model's dtype; the tokens come to the host in one copy (and the
    logprobs a request asked for in one more)."""
    wanting = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    # before any mask: the model's own
    raw = logits.index_select(0, device_index(wanting, logits.device)).float().log_softmax(-1) if wanting else None
    token_ids = sample_tokens(logits, requests).tolist()
    if raw is None:
        return [SampledToken(t, None) for t in token_ids]
    chosen = logprobs_of(raw, [token_ids[row] for row in wanting], [requests[row].sampling_params.logprobs
                                                                    for row in wanting])
    per_row = dict(zip(wanting, chosen))
    return [SampledToken(t, per_row.get(row)) for row, t in enumerate(token_ids)]


def sample_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The rows' token ids, int64 [rows] on the logits' device (nothing waits on the device). Greedy rows read the
    logits as they are (no widened copy of the batch's); the rows that draw or are adjusted are widened to float32,
    alone. Grammar masks and adjustments go into `logits` in place."""
    constrained = [row for row, r in enumerate(requests) if r.grammar is not None]
    if constrained:
        mask_disallowed(logits, [requests[row].grammar for row in constrained], constrained)
    tokens = argmax_rows(logits)
    working = [row for row, r in enumerate(requests) if r.logits_adjuster is not None or not r.sampling_params.greedy]
    if working:
        rows, chosen = _rows(logits, working), [requests[row] for row in working]
        adjust_rows(rows, chosen)  # in place: the step's own logits where they are float32 and every row works
        greedy = [i for i, r in enumerate(chosen) if r.sampling_params.greedy]  # adjusted ones: their new argmax
        if greedy:
            tokens = _put(tokens, [working[i] for i in greedy], argmax_rows(_rows(rows, greedy)))
        drawing = [i for i, r in enumerate(chosen) if not r.sampling_params.greedy]
        if drawing:
            drawn = _draw_rows(_rows(rows, drawing), [chosen[i] for i in drawing])
            tokens = _put(tokens, [working[i] for i in drawing], drawn)
    return tokens


def logprobs_of(logprobs: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[dict[int, float]]:
    """Per row of `logprobs` [rows, vocab]: its chosen token's logprob first, then its top `num_top`."""
    index = device_index(tokens, logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    top = logprobs.topk(max(num_top))
    values, indices = top.values.tolist(), top.indices.tolist()
    out = []
    for row, (token, k) in enumerate(zip(tokens, num_top)):
        entry = {token: chosen[row]}
        for value, alternative in zip(values[row][:k], indices[row][:k]):
            entry.setdefault(alternative, value)
        out.append(entry)
    return out
