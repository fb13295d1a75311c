"""The batched sampler, on CPU tensors (the same code runs on the device the logits are on).

Counter-based draws are uniform, and a row's draw depends on (seed, position, lane) alone. A batch of rows
with different temperatures, top-k and top-p draws each row from its own filtered distribution (chi-square
over many positions), and a seeded row gets the same token whatever its neighbours, their number and order.
The penalties, logit_bias, min_tokens and allowed_token_ids applied to a batch at once equal each row adjusted
alone.
"""

import random

import pytest
import torch

from kvloom.engine.counter_draws import Lane, seed_words, uniform
from kvloom.engine.logits_processors import LogitsAdjuster, adjust_rows
from kvloom.engine.request import Request
from kvloom.engine.sampler import DrawKnobs, filtered_logits, sample, sampling_probs
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.speculation.rejection_sampler import verify

VOCAB = 40


def request(params: SamplingParams, seed: int, outputs: int = 0, prompt=(1, 2, 3)) -> Request:
    r = Request("r", list(prompt), params, draw_seed=seed_words(seed))
    r.token_ids.extend(t % VOCAB for t in range(outputs))  # `outputs` tokens so far: the next draw's position
    r.logits_adjuster = LogitsAdjuster.for_request(params, {0})
    return r


def test_counter_draws_are_uniform_and_depend_on_seed_position_and_lane_alone(chi_square_p):
    n = 100_000
    seeds = [seed_words(s) for s in range(-n // 2, n // 2)]  # negative seeds too: SamplingParams admits them
    u = torch.tensor([uniform(seed, i % 977, Lane.TOKEN) for i, seed in enumerate(seeds)])
    assert u.min() >= 0 and u.max() < 1
    assert chi_square_p(torch.histc(u, bins=64, min=0, max=1), torch.ones(64)) > 0.001
    # any one of the three changes the draw
    for other in ([uniform(seed, i % 977 + 1, Lane.TOKEN) for i, seed in enumerate(seeds)],
                  [uniform(seed, i % 977, Lane.ACCEPT) for i, seed in enumerate(seeds)],
                  [uniform(seed, i % 977, Lane.TOKEN) for i, seed in enumerate(seeds[1:] + seeds[:1])]):
        assert (torch.tensor(other) != u).float().mean() > 0.999
    # successive positions of one seed are not correlated
    one = torch.tensor([uniform(seed_words(7), i, Lane.TOKEN) for i in range(n)])
    assert abs(float(torch.corrcoef(torch.stack([one[:-1], one[1:]]))[0, 1])) < 0.015


MIXED = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
         SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=1.1, top_k=8, top_p=0.9),
         SamplingParams(temperature=0)]


def test_each_row_of_a_mixed_batch_draws_from_its_own_filtered_distribution(chi_square_p):
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), VOCAB) * 2
    draws = 4000
    counts = torch.zeros(len(MIXED), VOCAB)
    for draw in range(draws):  # a fresh seed per draw and row: counter-based draws are independent across seeds
        batch = [request(p, seed=draw * len(MIXED) + row, outputs=2) for row, p in enumerate(MIXED)]
        for row, token in enumerate(sample(logits.clone(), batch)):
            counts[row, token.token_id] += 1
    for row, params in enumerate(MIXED[:-1]):
        probs = sampling_probs(logits[row], params)
        assert counts[row][probs == 0].sum() == 0, f"{params}: a token outside top-k/top-p was drawn"
        assert chi_square_p(counts[row], probs) > 0.001, params
    assert counts[-1, int(logits[-1].argmax())] == draws  # the greedy row


def test_the_batched_filter_keeps_ties_with_the_kth_and_the_first_token_past_top_p():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.01)]  # the two paths: partial top-k, and the sort
    probs = filtered_logits(logits, DrawKnobs.of(params, 5, logits.device)).softmax(-1)
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]  # 2.0 ties with the 2nd best: both kept
    assert (probs[1] > 0).tolist() == [True, False, False, False, False]


def test_a_seeded_row_gets_the_same_token_whatever_its_neighbours_their_number_and_order():
    torch.manual_seed(1)
    rows = {name: (torch.randn(VOCAB) * 1.5, params) for name, params in
            zip("abcde", [SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=1.2, top_p=0.8),
                          SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=6, seed=5),
                          SamplingParams(temperature=0.8, presence_penalty=1.0)])}

    def tokens(names: list[str], position: int) -> dict[str, int]:
        batch = [request(rows[n][1], seed=rows[n][1].seed or 99, outputs=position) for n in names]
        sampled = sample(torch.stack([rows[n][0] for n in names]), batch)
        return {n: s.token_id for n, s in zip(names, sampled)}

    rng = random.Random(3)
    for position in range(50):
        alone = tokens(["a"], position)["a"], tokens(["d"], position)["d"]
        names = ["a", "d"] + rng.sample("bce", rng.randint(0, 3))
        rng.shuffle(names)
        together = tokens(names, position)
        assert (together["a"], together["d"]) == alone


def test_a_batch_adjusted_at_once_equals_each_row_adjusted_alone():
    torch.manual_seed(2)
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(presence_penalty=0.8, frequency_penalty=0.5),
              SamplingParams(logit_bias={3: 5.0, 7: -100.0}), SamplingParams(min_tokens=4, max_tokens=8),
              SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.0, logit_bias={0: 2.0}, min_tokens=3,
                             max_tokens=20),
              SamplingParams(allowed_token_ids=[9, 3, 30], logit_bias={3: 4.0}),
              SamplingParams()]
    outputs = [2, 5, 1, 3, 4, 2, 0]  # row 3 is below its min_tokens, row 4 past it
    batch = [request(p, seed=0, outputs=n, prompt=(4, 4, 9, 30)) for p, n in zip(params, outputs)]
    logits = torch.randn(len(params), VOCAB)
    together = logits.clone()
    adjust_rows(together, batch)
    for row, r in enumerate(batch):
        alone = logits[row : row + 1].clone()
        adjust_rows(alone, [r])
        assert torch.equal(together[row], alone[0]), params[row]
    assert torch.equal(together[-1], logits[-1])  # a row with nothing to adjust
    assert together[3, 0] == float("-inf") and together[4, 0] > float("-inf")  # EOS (token 0) held back, then not
    assert together[2, 7] < logits[2, 7] - 99
    allowed = together[5] > float("-inf")
    assert allowed.nonzero().flatten().tolist() == [3, 9, 30] and together[5, 3] == logits[5, 3] + 4.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_read_the_model_dtype_and_drawing_rows_do_not_change_them(dtype):
    torch.manual_seed(4)
    logits = (torch.randn(6, VOCAB) * 3).to(dtype)
    batch = [request(SamplingParams(temperature=0 if row % 2 else 1.0, logprobs=2 if row == 1 else None), seed=row)
             for row in range(6)]
    sampled = sample(logits.clone(), batch)
    for row in (1, 3, 5):
        assert sampled[row].token_id == int(logits[row].float().argmax())
    chosen = sampled[1].logprobs
    assert list(chosen)[0] == sampled[1].token_id and len(chosen) == 2  # the chosen one is also the best
    assert sampled[0].logprobs is None


def test_the_sampler_sends_its_host_tensors_through_pinned_staging(monkeypatch, host_reads):
    """Row indices, knobs and uniforms reach the logits' device through `to_device` (pinned, a non-blocking copy on
    CUDA), in sampling and in the verification of drafts: no tensor is built on the device from a Python list, nor
    are tensors indexed by one (each a blocking copy from pageable memory mid-step). A step's tokens come back in
    one copy, its logprobs in their own."""
    built_on_device, list_indexed = [], []
    tensor, getitem, setitem = torch.tensor, torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def watched_tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None:
            built_on_device.append(kwargs["device"])
        return tensor(data, *args, **kwargs)

    def watched(original):
        def index(self, key, *args):
            if isinstance(key, list) or isinstance(key, tuple) and any(isinstance(k, list) for k in key):
                list_indexed.append(key)
            return original(self, key, *args)
        return index

    torch.manual_seed(5)
    params = MIXED + [SamplingParams(temperature=0.8, presence_penalty=0.5, logit_bias={3: 2.0}),
                      SamplingParams(temperature=0, allowed_token_ids=[2, 5, 9], logprobs=1)]
    batch = [request(p, seed=row, outputs=3) for row, p in enumerate(params)]
    batch[-1].logits_adjuster.banned_by_allowed(VOCAB, torch.device("cpu"))  # once a request, built on the host
    drafted = [request(SamplingParams(temperature=0.9, top_k=5), seed=1),
               request(SamplingParams(temperature=0), seed=2)]
    drafted[0].spec_token_ids, drafted[1].spec_token_ids = [3, 4], [5]
    monkeypatch.setattr(torch, "tensor", watched_tensor)
    monkeypatch.setattr(torch.Tensor, "__getitem__", watched(getitem))
    monkeypatch.setattr(torch.Tensor, "__setitem__", watched(setitem))
    with host_reads() as reads:
        sample(torch.randn(len(params), VOCAB), batch)
    verify(torch.randn(5, VOCAB), drafted)  # its reads: tests/test_speculative_decoding.py
    assert built_on_device == [] and list_indexed == []
    assert reads == ["tolist"] * 4  # the tokens; the logprobs: chosen, top values, top indices
