"""Property tests: Scheduler + KVCacheManager driven without a model.

A fake model stands in for the runner. It writes a "KV" value into every slot it computes (a chained
hash of the request's tokens up to that position, i.e. what a correct model would store there),
reads back every slot of the request when it samples, and derives the sampled token from what it
read. So a block shared or evicted wrongly, a prefix hit on the wrong block, or a chunk that skips or
repeats tokens shows up as a failed check (and as a wrong generated token).

Checked on random workloads (arrivals over steps, shared prompt prefixes, aborts, small pools,
every block size / budget / policy / chunking / prefix-caching combination, distinct or tied
arrival times):
  (a) everything finishes or is aborted within a bounded number of steps;
  (b) afterwards every block is free with ref count 0 and the manager holds nothing;
  (c) no step exceeds the token budget or max_num_seqs;
  (d) a running request holds exactly ceil((computed + scheduled) / block_size) blocks, blocks are
      held only by running requests (ref count = number of holders), so used blocks <= the sum of
      those; the pool's peak counter equals the most blocks ever seen in use;
  (e) fcfs: the running requests are always an arrival-order prefix of the unfinished ones, so
      admission order and first-token order are arrival order; any policy admits in queue order;
  (f) priority: a waiting request that outranks a running one, when the batch or the pool is full,
      preempts the worst running one (also deterministic examples below);
  (g) the tokens fed to the model for a request are exactly prompt + generated tokens (all but the
      last sampled), in order, across chunks, preemptions (recompute) and prefix-cache hits, whose
      skipped tokens are exactly whole cached blocks holding the same tokens;
  (h) speculation (drafts of random length and accuracy, from the real `Speculator` with a fake proposer):
      the fake model verifies them against what it would generate, and the rollback over rejected drafts
      keeps (b), (d) and (g), never lets the prefix cache hold a rejected token's KV (a later hit would
      read it), and never yields a token past max_tokens; the outputs stay the reference generation.
"""

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvloom.engine.config import SpeculativeConfig
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.speculation.model_proposers import Proposer
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.request_queue import priority_key
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.scheduler import Scheduler, SchedulerLimits
from kvloom.engine.speculation.speculative import Speculator

VOCAB = 97  # small, so different requests often generate the same tokens too


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_hash(parent: int, token: int) -> int:
    return hash((parent, token))


def reference_generation(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates for `prompt` when its KV reads are all correct."""
    h = 0
    for t in prompt:
        h = next_hash(h, t)
    out = []
    for _ in range(max_tokens):
        tok = h % VOCAB
        out.append(tok)
        h = next_hash(h, tok)
    return out


# ---- scenario ---------------------------------------------------------------------------------------


@dataclass
class ReqSpec:
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    yields_prefill: bool = False  # the router marked its tenant as over its share (engine/prefill_yield.py)


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked: bool
    prefix_caching: bool
    policy: str
    requests: list[ReqSpec]  # in arrival order
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (step, request index)
    tied_arrivals: bool = False  # arrival_time = arrival step, so requests of one step tie
    num_speculative_tokens: int = 0  # 0: no speculation
    draft_seed: int = 0
    yielding_prefill_tokens: int = 16


class FakeDraftProposer(Proposer):
    """Drafts a random number of the tokens the fake model will generate, then a random wrong one or more."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, request: Request, k: int) -> list[int]:
        right = reference_generation(request.token_ids, k)
        length, correct = self.rng.randint(0, k), self.rng.randint(0, k)
        return [t if i < correct else (t + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
                for i, t in enumerate(right[:length])]


@st.composite
def scenarios(draw, policy=None, with_aborts=True, max_requests=12, yielding=True):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    chunked = draw(st.booleans())
    prefix_caching = draw(st.booleans())
    policy = policy or draw(st.sampled_from(["fcfs", "priority"]))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    shared = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(3)]
    shared_lens = [draw(st.integers(0, 200)) for _ in range(3)]

    n = draw(st.integers(1, max_requests))
    steps = sorted(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    specs = []
    for step in steps:
        length = draw(st.integers(1, 200))
        group = draw(st.sampled_from([None, 0, 1, 2]))
        head = [] if group is None else shared[group][: min(length, shared_lens[group])]
        prompt = head + [rng.randrange(VOCAB) for _ in range(length - len(head))]
        max_tokens = draw(st.integers(1, 60))
        priority = draw(st.integers(0, 3)) if policy == "priority" else 0
        specs.append(ReqSpec(step, prompt, max_tokens, priority, yielding and draw(st.booleans())))

    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    need = max(ceil_div(len(s.prompt) + s.max_tokens, block_size) for s in specs)
    num_blocks = need + draw(st.integers(0, 2 * need))
    max_num_seqs = draw(st.integers(1, 8))
    if chunked:
        budget = draw(st.integers(max_num_seqs, 300))
    else:
        budget = max(max_num_seqs, longest + draw(st.integers(0, 64)))
    aborts = []
    if with_aborts:
        aborts = draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, n - 1)), max_size=3))
    tied = draw(st.booleans())
    num_speculative_tokens = draw(st.sampled_from([0, 0, 1, 3, 6]))
    return Scenario(block_size, num_blocks, max_num_seqs, budget, chunked, prefix_caching, policy,
                    specs, aborts, tied, num_speculative_tokens, draw(st.integers(0, 2**32 - 1)),
                    draw(st.integers(1, 32)))


# ---- the simulator ---------------------------------------------------------------------------------


class Simulation:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.kv = KVCacheManager(sc.num_blocks, sc.block_size, sc.prefix_caching)
        self.sched = Scheduler(
            SchedulerLimits(sc.max_num_seqs, sc.max_num_batched_tokens, sc.chunked, sc.policy,
                            yielding_prefill_tokens=sc.yielding_prefill_tokens), self.kv
        )
        bs = sc.block_size
        self.slots: list[list[int | None]] = [[None] * bs for _ in range(sc.num_blocks)]
        self.requests: list[Request] = []
        self.prefix_hash: dict[str, list[int]] = {}  # expected KV value per position
        self.fed: dict[str, list[int]] = {}  # tokens whose KV this life of the request has
        self.aborted: set[str] = set()
        self.admission_order: list[str] = []  # first admissions
        self.first_token: dict[str, tuple[int, int]] = {}  # id -> (step, position in the step)
        self.max_used_seen = 0
        self.step = 0
        self.total_prefix_hit_tokens = 0
        self.waiter_preemptions = 0  # (f) situations met
        self.speculator = None
        if sc.num_speculative_tokens:
            config = SpeculativeConfig(method="ngram", num_speculative_tokens=sc.num_speculative_tokens)
            self.speculator = Speculator(config, max_model_len=10**6, proposer=FakeDraftProposer(sc.draft_seed))
        self._instrument_pool()

    def _instrument_pool(self) -> None:
        pool = self.kv.pool
        allocate, touch = pool.allocate, pool.touch

        def allocate_seen(count):
            result = allocate(count)
            self.max_used_seen = max(self.max_used_seen, pool.num_used)
            return result

        def touch_seen(block):
            touch(block)
            self.max_used_seen = max(self.max_used_seen, pool.num_used)

        pool.allocate, pool.touch = allocate_seen, touch_seen

    # -- expected KV --
    def expected(self, r: Request, upto: int) -> list[int]:
        """KV values of the first `upto` positions of the request's tokens and its drafts."""
        ph = self.prefix_hash[r.request_id]
        tokens = r.token_ids + r.spec_token_ids
        while len(ph) < upto:
            ph.append(next_hash(ph[-1] if ph else 0, tokens[len(ph)]))
        return ph[:upto]

    def read_kv(self, r: Request, upto: int) -> list[int | None]:
        bs = self.sc.block_size
        values: list[int | None] = []
        for j in range(ceil_div(upto, bs)):
            values.extend(self.slots[r.block_ids[j]])
        return values[:upto]

    # -- driving --
    def bound(self) -> int:
        specs = self.sc.requests
        work = sum(len(s.prompt) + s.max_tokens for s in specs)
        # a yielding prompt waits out every step computing another's, and whoever it preempts recomputes later
        return specs[-1].arrival_step + (16 if any(s.yields_prefill for s in specs) else 4) * work + 100

    def run(self) -> "Simulation":
        sc, sched = self.sc, self.sched
        by_step: dict[int, list[int]] = {}
        for i, spec in enumerate(sc.requests):
            by_step.setdefault(spec.arrival_step, []).append(i)
        aborts: dict[int, list[int]] = {}
        for step, index in sc.aborts:
            aborts.setdefault(step, []).append(index)
        last_arrival = sc.requests[-1].arrival_step
        limit = self.bound()

        while self.step <= last_arrival or sched.has_unfinished:
            assert self.step < limit, f"no progress after {self.step} steps (livelock/deadlock)"
            for i in by_step.get(self.step, []):
                spec = sc.requests[i]
                r = Request(f"r{i}", list(spec.prompt), SamplingParams(max_tokens=spec.max_tokens),
                            priority=spec.priority, arrival_time=self.arrival_time(i),
                            yields_prefill=spec.yields_prefill)
                self.requests.append(r)
                self.prefix_hash[r.request_id] = []
                sched.add_request(r)
            for i in aborts.get(self.step, []):
                if i < len(self.requests) and not self.requests[i].is_finished:
                    self.abort(self.requests[i])
            self.one_step()
            self.step += 1
        return self

    def arrival_time(self, i: int) -> float:
        return float(self.sc.requests[i].arrival_step if self.sc.tied_arrivals else i)

    def before(self, a, b) -> bool:
        """Queue order: strictly before, or not after when arrival times may tie."""
        return a <= b if self.sc.tied_arrivals else a < b

    def abort(self, r: Request) -> None:
        self.sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(r.request_id)
        assert r.block_ids == [] and self.kv.num_held(r.request_id) == 0
        assert r not in self.sched.running and r not in list(self.sched.waiting)

    def one_step(self) -> None:
        sc, sched, kv, bs = self.sc, self.sched, self.kv, self.sc.block_size
        was_running = {r.request_id for r in sched.running}
        expected_victim = self.expected_priority_victim()
        preemptions_before = sched.num_preemptions

        if self.speculator is not None:
            self.speculator.propose(sched.running)
        out = sched.schedule()

        # ---- (f) a waiting request outranking a running one preempts it when the batch/pool is full
        if expected_victim is not None:
            self.waiter_preemptions += 1
            assert expected_victim in out.preempted, "higher-priority waiter did not preempt"
            assert sched.num_preemptions > preemptions_before
        assert sched.num_preemptions == preemptions_before + len(out.preempted)
        for r in out.preempted:
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            assert r.block_ids == [] and kv.num_held(r.request_id) == 0
            assert r not in sched.running and r in list(sched.waiting)
            self.fed.pop(r.request_id, None)

        # ---- (c) limits
        planned = {r.request_id: n for r, n in out.scheduled}
        assert len(planned) == len(out.scheduled)
        assert out.num_batched_tokens <= sc.max_num_batched_tokens
        assert len(out.scheduled) <= sc.max_num_seqs and len(sched.running) <= sc.max_num_seqs
        for r, n in out.scheduled:
            assert r.status == RequestStatus.RUNNING and r in sched.running
            assert 1 <= n <= r.num_tokens_with_spec - r.num_computed_tokens
            assert not r.spec_token_ids or n == r.num_tokens_with_spec - r.num_computed_tokens
            if not sc.chunked:
                assert n == r.num_tokens_with_spec - r.num_computed_tokens, "prefill split without chunking"
        if out.preempted and expected_victim is None:  # pool pressure: no admissions this step
            assert not (set(planned) - was_running), "admitted in a step that preempted"

        # ---- admissions (and (e): queue order)
        admitted = [r for r in sched.running if r.request_id not in was_running]
        for r in admitted:
            assert r.request_id in planned
            self.check_admission(r)
        waiting = list(sched.waiting)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
        assert all(r.block_ids == [] and r.num_computed_tokens == 0 for r in waiting)
        key = self.queue_key
        # a yielding request waiting for a step with room for its prompt may be passed (engine/prefill_yield.py)
        in_order = [r for r in waiting if not r.yields_prefill]
        if admitted and in_order:
            assert self.before(max(map(key, admitted)), min(map(key, in_order))), "admitted out of order"
        if sc.policy == "fcfs":
            arrivals = [r.arrival_time for r in sched.running if not r.yields_prefill]
            assert arrivals == sorted(arrivals)
            if arrivals and in_order:
                assert self.before(max(arrivals), min(r.arrival_time for r in in_order))

        # ---- (d) block accounting
        holders: dict[int, int] = {}
        bound = 0
        for r in sched.running:
            upto = r.num_computed_tokens + planned.get(r.request_id, 0)
            assert len(r.block_ids) == kv.num_held(r.request_id) == ceil_div(upto, bs)
            bound += ceil_div(upto, bs)
            for b in r.block_ids:
                holders[b] = holders.get(b, 0) + 1
        assert set(kv._held) == {r.request_id for r in sched.running}
        pool = kv.pool
        assert pool.num_used == len(holders) <= bound
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.block_id in pool.free) == (block.ref_cnt == 0)
        assert pool.peak_num_used == self.max_used_seen >= pool.num_used

        # ---- the fake model: write KV, read it back, sample from what was read
        sampled: dict[str, list[int]] = {}
        for r, n in out.scheduled:
            c = r.num_computed_tokens
            fed = self.fed[r.request_id]
            assert len(fed) == c, "chunk does not start where the last one ended"
            fed.extend((r.token_ids + r.spec_token_ids)[c : c + n])
            ph = self.expected(r, c + n)
            for p in range(c, c + n):
                block = pool.blocks[r.block_ids[p // bs]]
                assert block.ref_cnt == 1 and block.block_hash is None, "writing a shared/cached block"
                self.slots[block.block_id][p % bs] = ph[p]
        for r, n in out.scheduled:  # attention reads every position up to the chunk's end
            end = r.num_computed_tokens + n
            seen = self.read_kv(r, end)
            assert seen == self.expected(r, end), "model read wrong KV"
            if end == r.num_tokens_with_spec:  # (h) verify: keep drafts while they are what it generates
                drafts = r.spec_token_ids
                targets = [value % VOCAB for value in seen[end - len(drafts) - 1 :]]
                kept = 0
                while kept < len(drafts) and drafts[kept] == targets[kept]:
                    kept += 1
                sampled[r.request_id] = targets[: kept + 1]

        drafted = {r.request_id: len(r.spec_token_ids) for r, _ in out.scheduled}
        written = {r.request_id: r.num_computed_tokens + n for r, n in out.scheduled}
        if self.speculator is not None:
            self.speculator.record(out.scheduled, sampled)
        advanced = sched.update_from_output(out, sampled)
        assert {r.request_id for r in advanced} == set(sampled)
        for r, _ in out.scheduled:
            assert r.spec_token_ids == []
            del self.prefix_hash[r.request_id][r.num_computed_tokens :]  # rejected drafts' KV is dead
            del self.fed[r.request_id][r.num_computed_tokens :]
            if drafted[r.request_id]:  # (d) after a rollback: no block beyond the known tokens' blocks
                held = min(ceil_div(written[r.request_id], bs), ceil_div(r.num_tokens, bs))
                assert len(r.block_ids) == kv.num_held(r.request_id) == held
        for position, r in enumerate(advanced):
            # (g) everything but the newest token has been fed, in order
            assert self.fed[r.request_id] == r.token_ids[:-1]
            assert r.num_output_tokens <= r.sampling_params.max_tokens, "(h) a token past max_tokens"
            self.first_token.setdefault(r.request_id, (self.step, position))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                assert r.block_ids == [] and kv.num_held(r.request_id) == 0
                self.fed.pop(r.request_id)

    def queue_key(self, r: Request):
        return priority_key(r) if self.sc.policy == "priority" else r.arrival_time

    def expected_priority_victim(self) -> Request | None:
        sched, sc = self.sched, self.sc
        if sc.policy != "priority" or not sched.running or not len(sched.waiting):
            return None
        # no eviction for a yielding prompt, which may wait a step anyway (engine/prefill_yield.py)
        outranking = [r for r in sched.waiting if not (r.yields_prefill and sc.chunked)]
        if not outranking:
            return None
        head = min(outranking, key=priority_key)
        worst = max(sched.running, key=priority_key)
        if priority_key(worst) <= priority_key(head):
            return None
        first_chunk = min(head.num_tokens, sc.max_num_batched_tokens)
        full = (len(sched.running) >= sc.max_num_seqs
                or self.kv.blocks_needed(first_chunk) > self.kv.pool.num_free)
        return worst if full else None

    def check_admission(self, r: Request) -> None:
        """(g) at admission: skipped tokens are exactly whole cached blocks holding those tokens."""
        sc, bs, pool = self.sc, self.sc.block_size, self.kv.pool
        c = r.num_computed_tokens
        assert c % bs == 0 and 0 <= c < r.num_tokens
        if not sc.prefix_caching:
            assert c == 0
        if r.num_preemptions == 0:
            assert r.num_cached_prompt_tokens == c
            self.admission_order.append(r.request_id)
        for j in range(c // bs):
            block = pool.blocks[r.block_ids[j]]
            assert block.block_hash is not None and block.block_hash == r.block_hashes[j]
            assert block.token_ids == tuple(r.token_ids[j * bs : (j + 1) * bs])
        if c:
            assert self.read_kv(r, c) == self.expected(r, c), "prefix hit on a block with other KV"
        self.total_prefix_hit_tokens += c
        self.fed[r.request_id] = list(r.token_ids[:c])

    # -- after the run --
    def check_final(self) -> None:
        sc, kv, pool = self.sc, self.kv, self.kv.pool
        # (a)
        assert not self.sched.has_unfinished and not self.sched.running and len(self.sched.waiting) == 0
        assert len(self.requests) == len(sc.requests)
        for r, spec in zip(self.requests, sc.requests):
            assert r.is_finished
            if r.request_id in self.aborted:
                assert r.status == RequestStatus.FINISHED_ABORTED
            else:
                assert r.status == RequestStatus.FINISHED_LENGTH
                assert r.output_token_ids == reference_generation(spec.prompt, spec.max_tokens)
            assert r.block_ids == [] and r.block_hashes == []
        # (b)
        assert pool.num_free == pool.num_blocks and pool.num_used == 0
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert kv.num_requests_holding == 0 and kv._held == {}
        assert pool.peak_num_used == self.max_used_seen <= pool.num_blocks
        assert kv.stats.hits <= kv.stats.queries and kv.stats.hits % sc.block_size == 0
        assert kv.stats.hits == self.total_prefix_hit_tokens
        # (e) fcfs: first admissions and first tokens in arrival order (a yielding prompt may be passed)
        if sc.policy == "fcfs":
            in_order = [i for i in self.admission_order if not sc.requests[int(i[1:])].yields_prefill]
            assert in_order == sorted(in_order, key=lambda i: int(i[1:]))
            got = sorted((i for i in self.first_token if not sc.requests[int(i[1:])].yields_prefill),
                         key=lambda i: int(i[1:]))
            times = [self.first_token[i] for i in got]
            assert times == sorted(times), "first tokens out of arrival order"


def simulate(sc: Scenario) -> Simulation:
    sim = Simulation(sc).run()
    sim.check_final()
    return sim


def record_events(sim: Simulation) -> None:
    """Coverage notes for `--hypothesis-show-statistics`."""
    event(f"preempted: {sim.sched.num_preemptions > 0}")
    event(f"prefix hits: {sim.kv.stats.hits > 0}")
    event(f"aborted: {bool(sim.aborted)}")
    event(f"evictions: {sim.kv.pool.num_evictions > 0}")
    if sim.sc.policy == "priority":
        event(f"priority waiter preempted a running request: {sim.waiter_preemptions > 0}")
    if sim.speculator is not None:
        stats = sim.speculator.stats
        event(f"drafts accepted: {0 < stats.num_accepted_tokens}, rejected: "
              f"{stats.num_accepted_tokens < stats.num_draft_tokens}")


# ---- properties -------------------------------------------------------------------------------------

COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=300, **COMMON)
@given(scenarios())
def test_random_workloads_keep_every_invariant(sc):
    record_events(simulate(sc))


@settings(max_examples=150, **COMMON)
@given(scenarios(policy="fcfs", with_aborts=False, yielding=False))
def test_fcfs_without_aborts_serves_in_arrival_order(sc):
    sim = simulate(sc)
    record_events(sim)
    ids = [r.request_id for r in sim.requests]
    assert sim.admission_order == ids  # every request admitted, in arrival order
    assert sorted(sim.first_token, key=lambda i: int(i[1:])) == ids


@settings(max_examples=150, **COMMON)
@given(scenarios(policy="priority"))
def test_priority_workloads_keep_every_invariant(sc):
    record_events(simulate(sc))


# ---- deterministic examples ------------------------------------------------------------------------


def scenario(**kw) -> Scenario:
    base = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                chunked=True, prefix_caching=True, policy="fcfs", requests=[], aborts=[])
    base.update(kw)
    return Scenario(**base)


def test_the_harness_sees_prefix_hits_preemptions_and_aborts():
    shared = list(range(1, 41))
    reqs = [ReqSpec(step, shared + [50 + step], 30) for step in range(0, 12, 2)]
    sim = simulate(scenario(block_size=4, num_blocks=24, max_num_batched_tokens=16,
                            requests=reqs, aborts=[(6, 1)]))
    assert sim.kv.stats.hits > 0
    assert sim.sched.num_preemptions > 0
    assert sim.aborted == {"r1"}


def test_harness_catches_a_chunk_that_skips_tokens(monkeypatch):
    """Sanity: a scheduler that loses a token is caught by (g)."""
    reqs = [ReqSpec(0, list(range(10)), 3)]
    sc = scenario(requests=reqs, max_num_batched_tokens=4)
    original = Scheduler.update_from_output

    def lossy(self, out, sampled):
        for r, _ in out.scheduled:
            if r.num_computed_tokens == 4:
                r.num_computed_tokens += 1
        return original(self, out, sampled)

    monkeypatch.setattr(Scheduler, "update_from_output", lossy)
    with pytest.raises(AssertionError):
        simulate(sc)


def make(sched: Scheduler, rid: str, n: int, max_tokens: int, priority: int, arrival: float) -> Request:
    r = Request(rid, list(range(100 + n, 100 + 2 * n)), SamplingParams(max_tokens=max_tokens),
                priority=priority, arrival_time=arrival)
    sched.add_request(r)
    return r


def step(sched: Scheduler):
    """One step with a dummy model; returns the scheduler output."""
    out = sched.schedule()
    done = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
    for r in sched.update_from_output(out, {r.request_id: [7] for r in done}):
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    return out


def run_until_done(sched: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not sched.has_unfinished:
            return
        step(sched)
    raise AssertionError("scheduler made no progress")


def new_scheduler(policy="priority", max_num_seqs=4, num_blocks=64, block_size=4, budget=64):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, True, policy), kv)


class TestVictimWhenThePoolRunsDry:
    def two_decoding(self, policy, priorities):
        # block_size 1, 16 blocks (one request's worth): two 7-token prompts fill 14 blocks,
        # the first decode of each fills the rest
        sched = new_scheduler(policy=policy, max_num_seqs=2, num_blocks=16, block_size=1)
        a = make(sched, "a", 7, 9, priority=priorities[0], arrival=0.0)
        b = make(sched, "b", 7, 9, priority=priorities[1], arrival=1.0)
        step(sched)
        out = step(sched)
        assert out.preempted == [] and sched.kv.pool.num_free == 0
        return sched, a, b

    def test_fcfs_preempts_the_latest_arrival(self):
        sched, a, b = self.two_decoding("fcfs", (0, 0))
        out = step(sched)
        assert out.preempted == [b] and [r for r, _ in out.scheduled] == [a]
        assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 2

    def test_priority_preempts_the_least_urgent_even_if_it_came_first(self):
        sched, a, b = self.two_decoding("priority", (1, 0))
        out = step(sched)
        assert out.preempted == [a] and [r for r, _ in out.scheduled] == [b]

    def test_the_preempted_request_resumes_with_its_output_kept(self):
        sched, a, b = self.two_decoding("fcfs", (0, 0))
        run_until_done(sched)
        assert a.num_output_tokens == b.num_output_tokens == 9
        assert b.num_preemptions >= 1 and a.num_preemptions == 0


class TestPriorityPreemption:
    def test_a_more_urgent_request_preempts_when_the_batch_is_full(self):
        sched = new_scheduler(max_num_seqs=1)
        low = make(sched, "low", 8, 20, priority=5, arrival=0.0)
        step(sched)
        step(sched)
        assert low.status == RequestStatus.RUNNING and low.num_output_tokens == 2
        high = make(sched, "high", 8, 3, priority=0, arrival=1.0)
        out = step(sched)
        assert out.preempted == [low] and sched.num_preemptions == 1
        assert low.status == RequestStatus.PREEMPTED and low.block_ids == []
        assert low.num_computed_tokens == 0 and low.num_output_tokens == 2  # output kept
        out = step(sched)
        assert [r for r, _ in out.scheduled] == [high]
        for _ in range(3):
            step(sched)
        assert high.status == RequestStatus.FINISHED_LENGTH
        run_until_done(sched)
        assert low.num_output_tokens == 20 and sched.num_preemptions == 1
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks

    def test_a_more_urgent_request_preempts_when_the_pool_is_full(self):
        sched = new_scheduler(max_num_seqs=4, num_blocks=6, block_size=4)
        low = make(sched, "low", 20, 4, priority=3, arrival=0.0)  # 5 of 6 blocks
        step(sched)
        assert sched.kv.pool.num_free == 1
        high = make(sched, "high", 8, 2, priority=1, arrival=1.0)  # needs 2 blocks
        out = step(sched)
        assert low in out.preempted and sched.num_preemptions == 1
        out = step(sched)
        assert [r for r, _ in out.scheduled] == [high]

    def test_the_least_urgent_running_request_is_the_victim(self):
        sched = new_scheduler(max_num_seqs=3)
        a = make(sched, "a", 4, 30, priority=2, arrival=0.0)
        b = make(sched, "b", 4, 30, priority=4, arrival=1.0)
        c = make(sched, "c", 4, 30, priority=3, arrival=2.0)
        step(sched)
        assert {r.status for r in (a, b, c)} == {RequestStatus.RUNNING}
        make(sched, "h", 4, 1, priority=0, arrival=3.0)
        out = step(sched)
        assert out.preempted == [b]

    @pytest.mark.parametrize("priority", [1, 2])
    def test_an_equal_or_less_urgent_request_waits(self, priority):
        sched = new_scheduler(max_num_seqs=1)
        low = make(sched, "low", 8, 5, priority=1, arrival=0.0)
        step(sched)
        other = make(sched, "other", 8, 5, priority=priority, arrival=1.0)
        out = step(sched)
        assert out.preempted == [] and sched.num_preemptions == 0
        assert other.status == RequestStatus.WAITING and low.status == RequestStatus.RUNNING

    def test_no_preemption_when_there_is_room(self):
        sched = new_scheduler(max_num_seqs=2)
        make(sched, "low", 8, 5, priority=5, arrival=0.0)
        step(sched)
        high = make(sched, "high", 8, 5, priority=0, arrival=1.0)
        out = step(sched)
        assert out.preempted == [] and high.status == RequestStatus.RUNNING

    def test_fcfs_never_preempts_for_a_waiting_request(self):
        sched = new_scheduler(policy="fcfs", max_num_seqs=1)
        first = make(sched, "first", 8, 5, priority=5, arrival=0.0)
        step(sched)
        make(sched, "urgent", 8, 5, priority=0, arrival=1.0)
        out = step(sched)
        assert out.preempted == [] and first.status == RequestStatus.RUNNING


@pytest.mark.parametrize("status", ["waiting", "running", "preempted"])
def test_abort_in_any_state_frees_everything(status):
    sched = new_scheduler(policy="priority", max_num_seqs=1)
    low = make(sched, "low", 8, 20, priority=5, arrival=0.0)
    if status in ("running", "preempted"):
        step(sched)
    if status == "preempted":
        make(sched, "high", 8, 2, priority=0, arrival=1.0)
        step(sched)
        assert low.status == RequestStatus.PREEMPTED
    sched.finish_request(low, RequestStatus.FINISHED_ABORTED)
    assert low.status == RequestStatus.FINISHED_ABORTED and low.block_ids == []
    assert low not in sched.running and low not in list(sched.waiting)
    run_until_done(sched)
    pool = sched.kv.pool
    assert pool.num_free == pool.num_blocks and sched.kv.num_requests_holding == 0
