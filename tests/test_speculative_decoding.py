"""Speculative decoding: drafts change how fast tokens come, never which tokens come.

Greedy outputs with speculation are token-identical to those without, on SmolLM2 cut to four layers (its
tokenizer and shapes, a third of its compute), under chunked prefill, preemption, prefix-cache hits, stop
strings, max_tokens and aborts mid-speculation; served, on the whole SmolLM2. Sampled outputs keep
the target's distribution exactly (chi-square tests, fixed seeds), whatever the drafts.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloom.engine.config import EngineConfig, SpeculativeConfig
from kvloom.engine.counter_draws import seed_words
from kvloom.engine.errors import ConfigError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.speculation.model_proposers import Proposer
from kvloom.engine.speculation.ngram_proposer import NgramProposer
from kvloom.engine.speculation.rejection_sampler import verify
from kvloom.engine.request import Request
from kvloom.engine.sampler import sampling_probs
from kvloom.engine.sampling import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}

COPY_TASKS = [
    "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu.",
    "Rewrite in the passive voice: The cat chased the mouse around the garden twice.",
    "def add(a, b):\n    return a + b\n\nRename add to plus and show the whole code again.",
    "List the numbers from 1 to 30 separated by commas.",
    "Extract every name: Alice met Bob and Carol at the station, then Alice and Bob left for Dover.",
    "Copy this list and sort it: pear, apple, fig, banana, cherry, apple, kiwi.",
]
OPEN_TASKS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is to a beginner.",
    "Give me a short recipe for pancakes.",
]
RAW = ["1, 2, 3, 4, 5, 6, 7, 8,", "The quick brown fox jumps over the lazy dog. The quick brown fox"]


def smollm2_engine(model_dir, speculative_config=None, **knobs) -> LLMEngine:
    return LLMEngine(**{"dtype": "float32", "model": str(model_dir), "max_model_len": 512,
                        "speculative_config": speculative_config, **knobs})


def mixed_params() -> list[SamplingParams]:
    """max_tokens that end inside an accepted run, stop strings, EOS allowed or not."""
    return [SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop, ignore_eos=ignore_eos)
            for max_tokens, stop, ignore_eos in [
                (48, [], True), (17, [], False), (48, [","], False), (5, [], True), (48, ["Bob"], False),
                (33, [], False), (48, [], False), (48, ["\n\n"], True), (9, [], True), (48, [], True),
                (48, ["7"], False), (48, [], False)]]


def run(engine: LLMEngine, prompts, params, abort_after: dict[str, int] | None = None):
    """All prompts as one batch; `abort_after` maps a request id to the number of output tokens it is aborted at
    (or just past, when a step accepted several)."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    abort_after = dict(abort_after or {})
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
            elif len(output.outputs[0].token_ids) >= abort_after.get(output.request_id, float("inf")):
                del abort_after[output.request_id]
                assert engine.abort(output.request_id) is not None
    assert not abort_after, f"finished before their abort: {abort_after}"
    return {rid: (out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason)
            for rid, out in finished.items()}


@pytest.fixture(scope="module")
def target(smollm2_4_layers_dir):
    return smollm2_4_layers_dir


@pytest.fixture(scope="module")
def prompts(target):
    engine = smollm2_engine(target, kv_cache_memory_bytes=64 << 20)
    chats = [engine.apply_chat_template([{"role": "user", "content": t}]) for t in COPY_TASKS + OPEN_TASKS]
    return chats + [engine.encode(text) for text in RAW]


@pytest.fixture(scope="module")
def without_speculation(target, prompts):
    return run(smollm2_engine(target, kv_cache_memory_bytes=64 << 20), prompts, mixed_params())


METHODS = ["ngram", "draft_model", "layer_skip"]


def method_config(method: str, target) -> dict:
    return {
        "ngram": NGRAM,
        # the target drafting for itself: every draft must be kept
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(target)},
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 3},
    }[method]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_outputs_equal_decoding_without_speculation(target, prompts, without_speculation, method):
    engine = smollm2_engine(target, method_config(method, target), kv_cache_memory_bytes=64 << 20)
    assert run(engine, prompts, mixed_params()) == without_speculation
    stats = engine.spec_decode_stats
    assert stats.num_accepted_tokens > 50, stats
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    if method == "draft_model":
        assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_under_chunked_prefill_preemption_prefix_hits_and_aborts(target, prompts, without_speculation, method):
    # 20 blocks of 16 tokens for 8 concurrent requests of ~30-60 prompt tokens and up to 48 more:
    # preemption; chunks of 64 tokens; the second round finds the prompts' blocks in the prefix cache.
    bytes_per_token = 2 * 4 * 3 * 64 * 4  # K and V, 4 layers, 3 KV heads of 64, float32
    bytes_per_token *= 2 if method == "draft_model" else 1  # the draft (the target itself) has its own cache
    engine = smollm2_engine(target, method_config(method, target), kv_cache_memory_bytes=20 * 16 * bytes_per_token,
                            max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    assert run(engine, prompts, mixed_params()) == without_speculation
    assert engine.scheduler.num_preemptions > 0
    assert run(engine, prompts, mixed_params(), abort_after={"r0": 3, "r11": 5}) == {
        rid: out for rid, out in without_speculation.items() if rid not in ("r0", "r11")}
    assert engine.kv.stats.hits > 0
    assert engine.spec_decode_stats.num_accepted_tokens > 0
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    engine.speculator.propose([])  # a draft model's cache empties as its requests leave
    assert getattr(engine.speculator.proposer, "pool", engine.kv.pool).num_used == 0


# ---- sampling stays exact -------------------------------------------------------------------------------


def request_with_drafts(params: SamplingParams, drafts: list[int], draft_probs=None, seed: int = 0) -> Request:
    request = Request("r", [1, 2, 3], params, draw_seed=seed_words(seed))
    request.spec_token_ids, request.spec_probs = drafts, draft_probs
    return request


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3, top_p=0.7)],
    ids=["temperature", "top-k", "top-p"])
@pytest.mark.parametrize("draft", ["point-mass", "poor-draft-model"])
def test_rejection_sampling_keeps_the_target_distribution(params, draft, chi_square_p):
    torch.manual_seed(0)
    vocab, draws = 12, 6000
    target_logits = torch.randn(3, vocab) * 2  # two drafted positions and the bonus position
    # a point mass on a likely token (kept sometimes, not always), or a poor draft model whose distribution
    # has little to do with the target's, its drafts drawn from it
    fixed = [int(target_logits[0].argmax()), 7]
    draft_probs = torch.softmax(torch.randn(2, vocab) * 3, -1) if draft == "poor-draft-model" else None
    draft_generator = torch.Generator().manual_seed(99)
    first = torch.zeros(vocab)
    accepted_first = 0
    for seed in range(draws):  # each draw a request with its own seed: counter-based draws at the same position
        drafts = fixed if draft_probs is None else torch.multinomial(draft_probs, 1, generator=draft_generator)[:, 0].tolist()
        kept = verify(target_logits, [request_with_drafts(params, drafts, draft_probs, seed)])[0]
        first[kept[0].token_id] += 1
        accepted_first += len(kept) > 1
    p = sampling_probs(target_logits[0], params)
    assert chi_square_p(first, p) > 0.01
    assert first[p == 0].sum() == 0, "a token outside top-k/top-p was sampled"
    assert 0 < accepted_first < draws  # both the accepting and the rejecting paths ran


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_target_token_after_it():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([4, 6, 1, 8]):
        logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0)
    kept = verify(logits, [request_with_drafts(greedy, [4, 6, 2])])[0]
    assert [t.token_id for t in kept] == [4, 6, 1]
    kept = verify(logits, [request_with_drafts(greedy, [4, 6, 1])])[0]
    assert [t.token_id for t in kept] == [4, 6, 1, 8]


def mixed_verification_step(vocab: int = 30) -> tuple[torch.Tensor, list[Request]]:
    """A step with every kind of row verification sees: greedy drafts (two kept, the third refused), drafts of
    sampled requests as point masses (prompt lookup's) and with a draft model's distribution (one asking for
    logprobs), requests without drafts (sampled and greedy)."""
    torch.manual_seed(3)
    requests = [request_with_drafts(SamplingParams(temperature=0), [4, 6, 2], seed=1),
                request_with_drafts(SamplingParams(temperature=0.9, top_k=10), [7, 8, 9], seed=2),
                request_with_drafts(SamplingParams(temperature=1.1, top_p=0.8, logprobs=2), [1, 2, 3],
                                    torch.softmax(torch.randn(3, vocab), -1), seed=3),
                request_with_drafts(SamplingParams(temperature=0.7), [], seed=4),
                request_with_drafts(SamplingParams(temperature=0), [], seed=5)]
    logits = torch.randn(sum(len(r.spec_token_ids) + 1 for r in requests), vocab)
    for row, token in [(0, 4), (1, 6), (4, 7), (5, 8), (8, 1)]:  # likely drafts, kept sometimes
        logits[row, token] += 4
    return logits, requests


def token_ids(kept: list[list]) -> list[list[int]]:
    return [[t.token_id for t in tokens] for tokens in kept]


def test_verification_reads_the_device_once_a_step(host_reads, monkeypatch):
    """Every row is judged on the device, and the step's tokens come to the host in one copy (logprobs aside: one
    more, for the requests that ask). On CPU, where reading is free, rows after a refused draft are skipped: the
    same tokens."""
    from kvloom.engine.speculation import rejection_sampler

    logits, requests = mixed_verification_step()
    requests[2].sampling_params = requests[2].sampling_params.model_copy(update={"logprobs": None})
    on_cpu = verify(logits, requests)
    monkeypatch.setattr(rejection_sampler, "reads_are_free", lambda device: False)  # as on an accelerator
    with host_reads() as reads:
        as_on_device = verify(logits, requests)
    assert reads == ["tolist"]
    assert token_ids(as_on_device) == token_ids(on_cpu)
    assert len(on_cpu[0]) == 3 and [len(kept) for kept in on_cpu[3:]] == [1, 1]
    assert any(len(kept) < len(r.spec_token_ids) for kept, r in zip(on_cpu[1:3], requests[1:3])), \
        "no sampled request refused a draft before its last: nothing was skipped"


def test_a_seeded_requests_verified_tokens_do_not_depend_on_its_neighbours():
    """Counter-based draws at (seed, position, lane): a request verified alone, or with its neighbours in another
    order, keeps the same tokens with the same logprobs."""
    logits, requests = mixed_verification_step()
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + len(r.spec_token_ids) + 1)
    rows = [logits[start:end] for start, end in zip(starts, starts[1:])]
    together = verify(logits, requests)
    assert together[2][0].logprobs is not None
    for i, request in enumerate(requests):
        assert verify(rows[i], [request])[0] == together[i]
    assert verify(torch.cat(rows[::-1]), requests[::-1]) == together[::-1]


class FixedDrafts(Proposer):
    """A deliberately poor proposer: the same tokens whatever the context."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, request: Request, k: int) -> list[int]:
        return self.tokens[:k]


@pytest.mark.parametrize("proposer", ["fixed-drafts", "poor-draft-model"])
def test_sampled_engine_outputs_keep_the_target_distribution_with_a_poor_proposer(tiny_model_dir, build_tiny_model,
                                                                                  chi_square_p,
                                                                                  tmp_path, proposer):
    """The second output token is the first verified against a draft: over many seeds its distribution
    is the target's, p(x2) = sum over x1 of p(x1) p(x2 | x1), computed with transformers. The drafts are
    fixed tokens (a point mass q, as prompt lookup's), or come from another random model (a poor q)."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=40, ignore_eos=True)
    prompt = [5, 17, 99, 23, 5, 17]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        p1 = sampling_probs(model(torch.tensor([prompt])).logits[0, -1], params)
        support = p1.nonzero().flatten()
        rows = torch.tensor([prompt + [int(t)] for t in support])
        p2_given = torch.stack([sampling_probs(row, params) for row in model(rows).logits[:, -1]])
    p2 = (p1[support, None] * p2_given).sum(0)

    likely = int(p2.argmax())
    knobs = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_seqs=64)
    if proposer == "fixed-drafts":
        engine = LLMEngine(**knobs, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
        engine.speculator.proposer = FixedDrafts([likely, 3])
    else:
        draft_dir = build_tiny_model(tmp_path / "draft", seed=1)
        engine = LLMEngine(**knobs, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                        "model": str(draft_dir)})
    draws = 3000
    assert chi_square_p(torch.zeros_like(p2).index_fill_(0, torch.tensor([likely]), draws), p2) < 1e-6  # sanity
    for seed in range(draws):
        engine.add_request(f"s{seed}", prompt, params.model_copy(update={"seed": seed}))
    second = torch.zeros(p2.shape[0])
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                second[out.outputs[0].token_ids[1]] += 1
    stats = engine.spec_decode_stats
    assert stats.num_drafts == draws and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert second[p2 == 0].sum() == 0, "a token outside top-k was sampled"
    assert chi_square_p(second, p2) > 0.01


@pytest.mark.parametrize("config", [
    NGRAM,
    {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 1},
    {"method": "draft_model", "num_speculative_tokens": 3, "model": None},  # the target itself
], ids=["ngram", "layer_skip", "draft_model"])
def test_a_disaggregated_decode_engine_speculates_over_imported_kv(tiny_model_dir, config):
    """A decode replica adopts a request whose prompt KV came from a prefill replica, then speculates."""
    from kvloom.engine.kv_handoff import export_kv, import_kv

    if config["method"] == "draft_model":
        config = {**config, "model": str(tiny_model_dir)}
    make = lambda spec=None: LLMEngine(model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=8 << 20,  # noqa: E731
                                       dtype="float32", speculative_config=spec)
    colocated, prefill, decode = make(), make(), make(config)
    prompt = [5, 17, 99, 23, 5, 17, 99, 23, 5, 17, 42, 8, 5, 17, 99]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = run(colocated, [prompt], [params])["r0"]

    request = prefill.make_request("p", prompt, params.model_copy(update={"max_tokens": 1}))
    request.park_kv = True
    prefill.add_prepared(request)
    while prefill.has_unfinished():
        first = prefill.step()
    _, payload = export_kv(prefill, "p")
    assert import_kv(decode, decode.make_request("r0", prompt, params), first[0].outputs[0].token_ids[0], payload)
    prefill.release_parked("p")
    assert run(decode, [], [])["r0"][0] == expected[0]  # (its text starts after the first token, sent by prefill)
    assert decode.spec_decode_stats.num_drafts > 0
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


# ---- what is and is not speculated --------------------------------------------------------------------


def test_disable_by_batch_size_switches_drafting_off_for_large_batches(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
                       speculative_config={**NGRAM, "disable_by_batch_size": 2})
    engine.speculator.proposer = FixedDrafts([7, 7])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [10 + i, 11, 12], params)
    engine.step()  # prefills
    engine.step()  # three decoding: above the limit
    assert engine.spec_decode_stats.num_drafts == 0
    engine.abort("r2")
    engine.step()
    assert engine.spec_decode_stats.num_drafts == 2


def test_requests_whose_logits_are_adjusted_are_not_speculated_on(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
                       speculative_config=NGRAM)
    engine.speculator.proposer = FixedDrafts([7, 7, 7])
    for i, params in enumerate([SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.0),
                                SamplingParams(max_tokens=8, temperature=0, logit_bias={7: 5.0}),
                                SamplingParams(max_tokens=8, temperature=0, min_tokens=4)]):
        engine.add_request(f"r{i}", [10, 11, 12], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.spec_decode_stats.num_drafts == 0


class OracleDrafts(Proposer):
    """A perfect proposer: drafts what greedy decoding without speculation produced."""

    def __init__(self, prompt_len: int, outputs: dict[tuple[int, ...], list[int]]) -> None:
        self.prompt_len, self.outputs = prompt_len, outputs

    def propose(self, request: Request, k: int) -> list[int]:
        token_ids = request.token_ids
        produced = len(token_ids) - self.prompt_len
        return self.outputs[tuple(token_ids[: self.prompt_len])][produced : produced + k]


def test_drafts_never_run_past_max_tokens(tiny_model_dir):
    rng = random.Random(0)
    prompts = {max_tokens: [rng.randrange(3, 512) for _ in range(20)] for max_tokens in range(1, 12)}
    knobs = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)
    plain = LLMEngine(**knobs)
    params = {n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in prompts}
    expected = {tuple(prompt): run(plain, [prompt], [params[n]])["r0"][0] for n, prompt in prompts.items()}

    engine = LLMEngine(**knobs, speculative_config=NGRAM)
    engine.speculator.proposer = OracleDrafts(20, expected)
    for n, prompt in prompts.items():
        engine.add_request(f"r{n}", prompt, params[n])
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.outputs[0].token_ids) <= int(out.request_id[1:])
            if out.finished:
                assert out.outputs[0].token_ids == expected[tuple(out.prompt_token_ids)]
    stats = engine.spec_decode_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_a_draft_models_kv_cache_comes_out_of_the_same_budget(tiny_model_dir):
    """Both caches hold the same number of blocks; the budget pays for both (it once paid the target's alone and
    the draft's came on top)."""
    budget = 1 << 22
    engine = LLMEngine(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=budget, max_model_len=256,
                       speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                           "model": str(tiny_model_dir)})

    def size(caches) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)

    both = size(engine.runner.kv_caches) + size(engine.speculator.proposer.kv_caches)
    assert budget - both // engine.num_blocks < both <= budget


@pytest.mark.slow
def test_a_draft_model_must_share_the_target_vocabulary(smollm2_dir, tiny_model_dir):
    with pytest.raises(ConfigError, match="vocabulary") as info:
        smollm2_engine(smollm2_dir, {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tiny_model_dir)},
                       kv_cache_memory_bytes=64 << 20)
    assert info.value.key == "speculative_config.model"


def test_layer_skip_needs_fewer_layers_than_the_target_and_the_fused_decoder(tiny_model_dir):
    config = {"method": "layer_skip", "num_speculative_tokens": 2, "draft_layers": 2}
    knobs = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ConfigError, match="at most 1") as info:
        LLMEngine(**knobs, speculative_config=config)
    assert info.value.key == "speculative_config.draft_layers"
    with pytest.raises(ConfigError, match="fused decoder"):
        LLMEngine(**knobs, model_impl="transformers", speculative_config={**config, "draft_layers": 1})


@pytest.mark.parametrize("config, field", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "layer_skip", "num_speculative_tokens": 3}, "draft_layers"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_speculative_config_errors_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=config)


def test_ngram_lookup_defaults_follow_vllm():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest earlier occurrence first
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_ngram_lookup_proposes_what_followed_the_latest_longest_match(tokens, k, min_n, extra):
    max_n = min_n + extra
    assert NgramProposer(min_n, max_n).lookup(tokens, k) == brute_force_lookup(tokens, k, min_n, max_n)


# ---- served ---------------------------------------------------------------------------------------------

SERVED = {"kv_cache_memory_bytes": 128 << 20, "max_model_len": 512, "max_num_seqs": 8, "dtype": "float32"}


@pytest.mark.slow
def test_served_streams_with_speculation_equal_offline_greedy_and_metrics_count_drafts(ray_serve, deploy_app,
                                                                                       smollm2_dir):
    import httpx
    import openai

    from kvloom.cluster.config import ClusterConfig

    deploy_app(ClusterConfig.model_validate(
        {"engine": {**SERVED, "speculative_config": NGRAM}, "num_replicas": 1}))
    client = openai.OpenAI(base_url=f"{ray_serve}/v1", api_key="unused", timeout=120, max_retries=0)
    offline = LLMEngine(model=str(smollm2_dir), **SERVED)
    for task in COPY_TASKS[:3]:
        messages = [{"role": "user", "content": task}]
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0,
                                                stream=True)
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        expected = run(offline, [offline.apply_chat_template(messages)], [SamplingParams(max_tokens=48, temperature=0)])
        assert "".join(chunks) == expected["r0"][1]
        assert len([c for c in chunks if c]) < len(expected["r0"][0])  # some chunks carry several tokens

    values = {}
    for line in httpx.get(f"{ray_serve}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    drafted = sum(v for k, v in values.items() if k.startswith("kvloom:spec_decode_num_draft_tokens_total"))
    accepted = sum(v for k, v in values.items() if k.startswith("kvloom:spec_decode_num_accepted_tokens_total"))
    by_position = sum(v for k, v in values.items()
                      if k.startswith("kvloom:spec_decode_num_accepted_tokens_per_pos_total"))
    assert drafted > accepted > 0 and by_position == accepted


def test_a_draft_model_catches_up_on_a_long_prompt_in_forwards_of_at_most_the_step_budget(tiny_model_dir,
                                                                                            build_tiny_model, tmp_path):
    """Its first pass over a whole prompt (here after a prefix-cache hit of most of it) is chunked by
    max_num_batched_tokens, as the CUDA budget counts it; greedy tokens stay the target's."""
    knobs = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24, max_num_seqs=4,
                 max_num_batched_tokens=32)
    prompt = [(i * 7) % 400 + 3 for i in range(150)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLMEngine(**knobs)
    expected = run(plain, [prompt[:140], prompt], [greedy, greedy])
    engine = LLMEngine(**knobs, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                    "model": str(build_tiny_model(tmp_path / "draft", seed=1))})
    proposer = engine.speculator.proposer
    sizes, forward = [], proposer.forward
    proposer.forward = lambda ids, *rest: sizes.append(len(ids)) or forward(ids, *rest)
    assert run(engine, [prompt[:140]], [greedy])["r0"] == expected["r0"]
    assert run(engine, [prompt], [greedy])["r0"] == expected["r1"]  # 128 tokens cached: the draft saw none
    assert max(sizes) <= 32 and sum(s == 32 for s in sizes) >= 4
