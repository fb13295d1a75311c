"""Admission policies on synthetic arrivals: VTC fairness bound, weights, priority classes, aging,
no starvation, SJF; plus the quota buckets, key store and tenant config they rely on.

The fairness simulations drive the real AdmissionQueue (credit, VTC counters, policy) against a
fake replica that produces one token per running request per tick.
"""

import asyncio
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloom.cluster.config import ClusterConfig
from kvloom.replicas.messages import ReplicaStats
from kvloom.router.admission import AdmissionQueue
from kvloom.router.errors import APIError
from kvloom.router.policies import PolicyConfig, PriorityClasses, FCFS, ShortestJobFirst, make_policy
from kvloom.router.quotas import Quotas, QuotaState, TokenBucket
from kvloom.router.replica_table import ReplicaTable
from kvloom.router.tenants import TenantConfig, TenantRegistry, key_digest
from kvloom.router.ticket import Ticket
from kvloom.router.vtc import VirtualCounters

W_IN, W_OUT = 1.0, 2.0


def replica_stats(max_num_seqs: int) -> ReplicaStats:
    return ReplicaStats("r", max_num_seqs=max_num_seqs)


@dataclass(frozen=True)
class Arrival:
    tick: int
    tenant: str
    prompt: int
    output: int
    priority: int = 0


@dataclass
class Trace:
    dispatch_order: list[Ticket] = field(default_factory=list)
    service: list[dict[str, float]] = field(default_factory=list)  # per tick: weighted service / weight so far
    backlogged: list[set[str]] = field(default_factory=list)  # per tick: tenants with queued requests


async def simulate(arrivals: list[Arrival], weights: dict[str, float], slots: int, policy: str = "fair",
                   max_ticks: int = 100_000) -> Trace:
    """Run arrivals through AdmissionQueue on one replica with `slots` credit; one token per request per tick."""
    config = PolicyConfig(policy=policy, priority_aging_s=None)
    counters = VirtualCounters(W_IN, W_OUT)
    table = ReplicaTable(slack=0)
    queue = AdmissionQueue(table, max_queued=10_000, policy=make_policy(config, counters), counters=counters)
    trace = Trace()
    served = {t: 0.0 for t in weights}
    running: list[list] = []  # [ticket, replica, tokens left]
    waiting: list[tuple[Ticket, asyncio.Task]] = []
    outputs: dict[Ticket, int] = {}
    pending = sorted(arrivals, key=lambda a: a.tick)
    tick = 0
    while pending or waiting or running:
        table.report(replica_stats(slots))  # keep the fake replica fresh
        while pending and pending[0].tick <= tick:
            a = pending.pop(0)
            ticket = Ticket(f"{a.tenant}-{len(trace.dispatch_order) + len(waiting)}-{tick}", [], a.tenant, a.priority,
                            weights[a.tenant], a.prompt, a.prompt + a.output, arrival=float(tick))
            outputs[ticket] = a.output
            waiting.append((ticket, asyncio.create_task(queue.acquire(ticket))))
        await asyncio.sleep(0)
        for ticket, task in list(waiting):
            if task.done():
                waiting.remove((ticket, task))
                trace.dispatch_order.append(ticket)
                served[ticket.tenant] += W_IN * ticket.prompt_tokens / ticket.weight
                running.append([ticket, task.result(), outputs[ticket]])
        trace.service.append(dict(served))
        trace.backlogged.append(set(queue.counters.backlog))
        for entry in list(running):
            ticket, replica, left = entry
            queue.charge(ticket, 1)
            served[ticket.tenant] += W_OUT / ticket.weight
            entry[2] = left - 1
            if entry[2] == 0:
                running.remove(entry)
                queue.release(replica, ticket)
        tick += 1
        assert tick < max_ticks, "simulation made no progress"
    return trace


def max_backlogged_gap(trace: Trace, a: str, b: str) -> float:
    """max over intervals where both are backlogged of |service_a - service_b| gained in the interval."""
    gap, low, high = 0.0, None, None
    for service, backlogged in zip(trace.service, trace.backlogged):
        if a in backlogged and b in backlogged:
            diff = service[a] - service[b]
            low = diff if low is None else min(low, diff)
            high = diff if high is None else max(high, diff)
            gap = max(gap, high - low)
        else:
            low = high = None
    return gap


arrival_lists = st.lists(
    st.tuples(st.integers(0, 60), st.sampled_from(["a", "b", "c"]), st.integers(1, 12), st.integers(1, 12)),
    min_size=1, max_size=60,
).map(lambda xs: [Arrival(*x) for x in xs])


@settings(max_examples=60, deadline=None)
@given(arrivals=arrival_lists, slots=st.integers(1, 4),
       weights=st.tuples(st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 2.0])))
def test_vtc_service_gap_stays_within_bound_under_random_arrivals(arrivals, slots, weights):
    weights = dict(zip("abc", weights))
    trace = asyncio.run(simulate(arrivals, weights, slots))
    # Sheng et al. Thm 4.4: 2 x (w_in * max prompt + w_out * tokens a batch can generate), per unit weight
    largest = max(W_IN * a.prompt for a in arrivals) + W_OUT * slots * max(a.output for a in arrivals)
    bound = 2 * largest / min(weights.values())
    for x, y in (("a", "b"), ("a", "c"), ("b", "c")):
        assert max_backlogged_gap(trace, x, y) <= bound + 1e-9


def flood(tenants: list[str], n: int, prompt: int = 8, output: int = 8) -> list[Arrival]:
    return [Arrival(0, t, prompt, output) for t in tenants for _ in range(n)]


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0}, {"a": 3.0, "b": 1.0}])
def test_backlogged_service_follows_weights(weights):
    trace = asyncio.run(simulate(flood(["a", "b"], 200), weights, slots=4))
    both = [i for i, b in enumerate(trace.backlogged) if b == {"a", "b"}]
    start, end = trace.service[both[0]], trace.service[both[-1]]
    raw = {t: (end[t] - start[t]) * weights[t] for t in weights}  # un-normalised weighted service
    assert raw["a"] / raw["b"] == pytest.approx(weights["a"] / weights["b"], rel=0.05)


def test_fcfs_lets_a_flood_starve_the_other_tenant_and_fair_does_not():
    arrivals = flood(["a"], 40) + [Arrival(1, "b", 8, 8) for _ in range(3)]
    fcfs = asyncio.run(simulate(arrivals, {"a": 1.0, "b": 1.0}, slots=2, policy="fcfs"))
    fair = asyncio.run(simulate(arrivals, {"a": 1.0, "b": 1.0}, slots=2, policy="fair"))
    position = lambda trace: [i for i, t in enumerate(trace.dispatch_order) if t.tenant == "b"]  # noqa: E731
    assert position(fcfs) == [40, 41, 42]
    assert position(fair)[0] <= 3 and position(fair)[-1] <= 8


def test_returning_tenant_gets_no_banked_credit():
    """b idles while a is served alone; on return b is lifted to a's counter and they alternate."""
    arrivals = flood(["a"], 30) + [Arrival(50, "b", 8, 8) for _ in range(10)]
    trace = asyncio.run(simulate(arrivals, {"a": 1.0, "b": 1.0}, slots=1))
    tail = [t.tenant for t in trace.dispatch_order if t.arrival >= 0][-25:]
    first_b = tail.index("b")
    assert "a" in tail[first_b:first_b + 3], tail  # b does not get a long run to "catch up"


def test_fcfs_within_a_tenant():
    arrivals = [Arrival(i, "a", 8, 4) for i in range(6)] + [Arrival(i, "b", 8, 4) for i in range(6)]
    trace = asyncio.run(simulate(arrivals, {"a": 1.0, "b": 1.0}, slots=1))
    for tenant in "ab":
        mine = [t.arrival for t in trace.dispatch_order if t.tenant == tenant]
        assert mine == sorted(mine)


def ticket(name: str, priority: int = 0, arrival: float = 0.0, size: int = 10, tenant: str = "a") -> Ticket:
    return Ticket(name, [], tenant, priority, 1.0, size // 2, size, arrival=arrival)


def drain(policy, now: float = 0.0) -> list[str]:
    order = []
    while len(policy):
        t = policy.peek(now)
        policy.remove(t)
        order.append(t.request_id)
    return order


def test_priority_classes_are_strictly_ordered_without_aging():
    policy = PriorityClasses(FCFS, aging_s=None)
    for i, p in enumerate([3, 1, 2, 1, 0, 3]):
        policy.push(ticket(f"{p}-{i}", p, arrival=float(i)))
    assert drain(policy, now=1e6) == ["0-4", "1-1", "1-3", "2-2", "3-0", "3-5"]


def test_aging_lifts_a_waiting_class_one_level_per_period():
    policy = PriorityClasses(FCFS, aging_s=10.0)
    policy.push(ticket("low", priority=2, arrival=0.0))
    policy.push(ticket("high", priority=0, arrival=15.0))
    assert policy.peek(now=15.0).request_id == "high"  # low waited 15 s: one level, still behind
    assert policy.peek(now=20.0).request_id == "low"  # 20 s: two levels, ties, and it is older


@pytest.mark.parametrize("policy_name", ["priority", "priority+fair"])
def test_no_starvation_with_aging_under_a_continuous_high_priority_stream(policy_name):
    policy = make_policy(PolicyConfig(policy=policy_name, priority_aging_s=5.0), VirtualCounters())
    policy.push(ticket("low", priority=3, arrival=0.0))
    served_at = None
    for now in range(100):  # a new class-0 request every second, one dispatch per second
        policy.push(ticket(f"high-{now}", priority=0, arrival=float(now), tenant="b"))
        chosen = policy.peek(float(now))
        policy.remove(chosen)
        if chosen.request_id == "low":
            served_at = now
            break
    assert served_at is not None and served_at <= 16  # 3 levels x 5 s, plus the tie


def test_without_aging_a_low_class_waits_for_the_high_stream():
    policy = make_policy(PolicyConfig(policy="priority", priority_aging_s=None), VirtualCounters())
    policy.push(ticket("low", priority=3))
    for now in range(50):
        policy.push(ticket(f"high-{now}", priority=0, arrival=float(now)))
        chosen = policy.peek(float(now))
        policy.remove(chosen)
        assert chosen.request_id != "low"


def test_sjf_runs_short_jobs_first_and_ages_long_ones():
    policy = ShortestJobFirst(aging_tokens_per_s=10.0)
    policy.push(ticket("long", size=500, arrival=0.0))
    policy.push(ticket("short", size=20, arrival=1.0))
    assert policy.peek(now=1.0).request_id == "short"
    for now in range(1, 100):  # a stream of short jobs cannot hold the long one back forever
        policy.push(ticket(f"s{now}", size=20, arrival=float(now)))
        chosen = policy.peek(float(now))
        policy.remove(chosen)
        if chosen.request_id == "long":
            break
    assert chosen.request_id == "long" and now <= 50


# ---- AdmissionQueue mechanics ---------------------------------------------------------------
async def test_high_priority_gets_credit_beyond_a_full_lower_class():
    table = ReplicaTable(slack=0)
    table.report(replica_stats(2))
    queue = AdmissionQueue(table, 10, make_policy(PolicyConfig(policy="priority", priority_aging_s=None), VirtualCounters()))
    lows = [ticket(f"low{i}", priority=5) for i in range(2)]
    held = [await queue.acquire(t) for t in lows]
    blocked = asyncio.create_task(queue.acquire(ticket("low-queued", priority=5)))
    await asyncio.sleep(0)
    assert not blocked.done()
    urgent = ticket("urgent", priority=0)
    assert (await asyncio.wait_for(queue.acquire(urgent), 1)).replica_id == "r"
    assert table.replicas["r"].inflight == 3  # over credit: the engine preempts a low one for it
    queue.release(held[0], lows[0])
    await asyncio.sleep(0)
    assert not blocked.done()  # the urgent request counts against every class at or below it
    queue.release(held[1], urgent)
    await asyncio.wait_for(blocked, 1)


async def test_the_scaling_backlog_counts_the_queued_requests_of_the_chosen_classes_only():
    """autoscaling.scale_for_priority: a batch class (a worse priority) queued in the router is no reason to add
    replicas; the interactive classes at or better than the setting are."""
    table = ReplicaTable(slack=0)
    table.report(replica_stats(1))
    queue = AdmissionQueue(table, 10, make_policy(PolicyConfig(policy="priority", priority_aging_s=None), VirtualCounters()))
    held = await queue.acquire(ticket("running", priority=0))
    waiting = [asyncio.create_task(queue.acquire(ticket(f"p{p}-{i}", priority=p))) for p in (0, 2, 5) for i in range(p + 1)]
    await asyncio.sleep(0)
    assert len(queue) == 10  # 1 + 3 + 6 behind the running one
    assert [queue.queued_up_to(p) for p in (None, 0, 2, 4, 5)] == [10, 1, 4, 4, 10]
    for task in waiting:
        task.cancel()
    queue.release(held)


@pytest.mark.parametrize("weights, b_share", [((1.0, 1.0), 2), ((3.0, 1.0), 1), ((1.0, 3.0), 3)])
async def test_a_tenant_below_its_share_of_a_full_replica_goes_in_to_preempt(weights, b_share):
    table = ReplicaTable(slack=0)
    table.report(replica_stats(4))
    counters = VirtualCounters()
    queue = AdmissionQueue(table, 100, make_policy(PolicyConfig(policy="fair"), counters), counters)
    queue.fair_share_preemption = True
    flood = [Ticket(f"a{i}", [], "A", weight=weights[0], prompt_tokens=10, arrival=float(i)) for i in range(8)]
    tasks = [asyncio.create_task(queue.acquire(t)) for t in flood]
    await asyncio.sleep(0)
    assert table.replicas["r"].inflight == 4 and not any(t.boosted for t in flood[:4])
    light = [Ticket(f"b{i}", [], "B", weight=weights[1], prompt_tokens=10, arrival=10.0 + i) for i in range(2)]
    tasks += [asyncio.create_task(queue.acquire(t)) for t in light]
    await asyncio.sleep(0)  # b0 is lifted to A's counter and wins the tie (nothing of B's in flight)
    assert light[0].future.done() and light[0].boosted and light[0].engine_priority < flood[0].engine_priority
    assert not light[1].future.done()  # VTC order still rules: A is behind in service now
    queue.release(table.replicas["r"], flood[0])  # b0 took that slot: still full
    assert not flood[4].future.done()
    queue.release(table.replicas["r"], flood[1])  # A's next goes in normally, then B's turn again
    assert flood[4].future.done() and not flood[4].boosted
    assert light[1].future.done() == (b_share >= 2)  # only while B stays within its share of the 4 slots
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_tenant_within_its_share_is_boosted_even_with_credit_to_spare():
    table = ReplicaTable(slack=0)
    table.report(replica_stats(4))
    counters = VirtualCounters()
    queue = AdmissionQueue(table, 100, make_policy(PolicyConfig(policy="fair"), counters), counters)
    queue.fair_share_preemption = True
    flood = [Ticket(f"a{i}", [], "A") for i in range(3)]
    for t in flood:
        await queue.acquire(t)
    light = Ticket("b", [], "B")
    await queue.acquire(light)  # a free slot: no preemption needed, but it goes before A's in the engine
    assert light.boosted and not any(t.boosted for t in flood[1:])


async def test_no_fair_share_preemption_when_nobody_is_over_their_share():
    table = ReplicaTable(slack=0)
    table.report(replica_stats(2))
    counters = VirtualCounters()
    queue = AdmissionQueue(table, 100, make_policy(PolicyConfig(policy="fair"), counters), counters)
    queue.fair_share_preemption = True
    held = [await queue.acquire(Ticket(name, [], name)) for name in ("A", "B")]
    ticket_c = Ticket("C", [], "C")
    third = asyncio.create_task(queue.acquire(ticket_c))
    await asyncio.sleep(0)
    assert not ticket_c.future.done() and len(held) == 2
    third.cancel()


async def test_queue_wait_over_the_tenant_limit_is_503_naming_the_quota():
    table = ReplicaTable(slack=0)  # no replicas: everything waits
    queue = AdmissionQueue(table, 10)
    t = ticket("slow")
    t.max_wait_s = 0.05
    with pytest.raises(APIError) as err:
        await asyncio.wait_for(queue.acquire(t), 2)
    assert err.value.status == 503 and err.value.code == "max_queue_wait_s"
    assert err.value.headers["Retry-After"] == "1" and len(queue) == 0 and not queue.counters.backlog


async def test_switching_policy_keeps_waiting_requests():
    table = ReplicaTable(slack=0)
    queue = AdmissionQueue(table, 10)
    tasks = [asyncio.create_task(queue.acquire(ticket(f"t{i}", priority=2 - i, arrival=float(i)))) for i in range(3)]
    await asyncio.sleep(0)
    queue.set_policy(make_policy(PolicyConfig(policy="priority", priority_aging_s=None), VirtualCounters()))
    assert len(queue) == 3 and queue.policy.peek(0.0).request_id == "t2"
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(queue) == 0


# ---- quotas ---------------------------------------------------------------------------------
def test_token_bucket_refills_and_carries_debt():
    bucket = TokenBucket.per_minute(60, now=0.0)
    bucket.take(60 + 30)  # 30 tokens of debt
    assert bucket.wait_for(1, now=0.0) == pytest.approx(31.0)
    assert bucket.wait_for(1, now=31.0) == 0.0
    bucket.resize(120, now=31.0)  # used stays used: level 1 of 60 -> 61 of 120
    assert bucket.level == pytest.approx(61.0)


def test_requests_per_minute_is_429_with_retry_after_on_the_right_request():
    state = QuotaState.create(Quotas(requests_per_minute=3), now=0.0)
    for _ in range(3):
        state.admit("t", 5, 5, now=0.0)
    with pytest.raises(APIError) as err:
        state.admit("t", 5, 5, now=0.0)
    assert err.value.status == 429 and err.value.code == "requests_per_minute"
    assert err.value.headers["Retry-After"] == "20" and "requests_per_minute" in err.value.message
    state.admit("t", 5, 5, now=20.0)


def test_tokens_per_minute_charges_prompt_at_admission_and_completion_as_debt():
    state = QuotaState.create(Quotas(tokens_per_minute=600), now=0.0)  # 10 tokens/s
    state.admit("t", 100, 1000, now=0.0)
    state.charge_completion(700)  # runs past the budget: the request still finishes
    state.finish(100, dispatched=True)
    with pytest.raises(APIError) as err:
        state.admit("t", 100, 10, now=0.0)  # level -200: 300 tokens short of the prompt
    assert err.value.code == "tokens_per_minute" and err.value.headers["Retry-After"] == "30"
    state.admit("t", 100, 10, now=30.0)


def test_undispatched_prompt_is_given_back_and_concurrency_released():
    state = QuotaState.create(Quotas(tokens_per_minute=600, max_concurrent_requests=1), now=0.0)
    state.admit("t", 500, 10, now=0.0)
    with pytest.raises(APIError) as err:
        state.admit("t", 50, 10, now=0.0)
    assert err.value.code == "max_concurrent_requests" and err.value.status == 429
    state.finish(500, dispatched=False)
    state.admit("t", 550, 10, now=0.0)


def test_size_limits_are_400_since_waiting_cannot_help():
    state = QuotaState.create(Quotas(tokens_per_minute=100, max_tokens_per_request=64), now=0.0)
    with pytest.raises(APIError) as err:
        state.admit("t", 40, 30, now=0.0)
    assert err.value.status == 400 and err.value.code == "max_tokens_per_request"
    state = QuotaState.create(Quotas(tokens_per_minute=100), now=0.0)
    with pytest.raises(APIError) as err:
        state.admit("t", 101, 1, now=0.0)
    assert err.value.status == 400 and err.value.code == "tokens_per_minute"


# ---- tenants and keys -----------------------------------------------------------------------
def tenants() -> list[TenantConfig]:
    return [TenantConfig(name="alice", api_keys=["sk-alice"], weight=2, priority=2, best_priority=1),
            TenantConfig(name="bob", api_keys=[key_digest("sk-bob")])]


def test_keys_map_to_tenants_and_are_held_only_as_digests():
    registry = TenantRegistry(tenants(), admin_keys=["sk-admin"])
    assert registry.authenticate("Bearer sk-alice").name == "alice"
    assert registry.authenticate("bearer sk-bob").name == "bob"  # configured by digest
    for header in (None, "", "Bearer", "Bearer sk-nobody", "Basic sk-alice", "Bearer sk-admin"):
        with pytest.raises(APIError) as err:
            registry.authenticate(header)
        assert err.value.status == 401
    registry.authenticate_admin("Bearer sk-admin")
    with pytest.raises(APIError):
        registry.authenticate_admin("Bearer sk-alice")
    assert b"sk-alice" not in pickle.dumps(registry) and b"sk-admin" not in pickle.dumps(registry)


def test_open_server_has_one_anonymous_tenant_with_any_priority():
    registry = TenantRegistry()
    tenant = registry.authenticate(None)
    assert tenant.name == "default" and tenant.effective_priority(-100) == -100
    registry.authenticate_admin(None)


def test_priority_is_the_tenant_default_and_bounded_by_its_best():
    alice = TenantRegistry(tenants()).authenticate("Bearer sk-alice")
    assert alice.effective_priority(None) == 2 and alice.effective_priority(1) == 1 and alice.effective_priority(9) == 9
    with pytest.raises(APIError) as err:
        alice.effective_priority(0)
    assert err.value.status == 403 and err.value.param == "priority"


def test_reload_keeps_usage_and_quota_state_and_revokes_removed_keys():
    registry = TenantRegistry(tenants())
    alice = registry.authenticate("Bearer sk-alice")
    alice.usage.completion_tokens = 42
    registry.reconfigure([TenantConfig(name="alice", api_keys=["sk-alice-2"], weight=5)], [])
    again = registry.authenticate("Bearer sk-alice-2")
    assert again is alice and again.weight == 5 and again.usage.completion_tokens == 42
    with pytest.raises(APIError):
        registry.authenticate("Bearer sk-bob")
    assert set(registry.usage()) == {"alice"}  # bob is gone and had used nothing
    registry.reconfigure([], [])
    assert set(registry.usage()) == {"alice", "default"}  # alice's past usage is still reported


@pytest.mark.parametrize("tenants_yaml, message", [
    ([{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}], "tenants[1].name"),
    ([{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}], "tenants[1].api_keys[0]"),
    ([{"name": "a", "api_keys": []}], "tenants.0.api_keys"),
    ([{"name": "a b", "api_keys": ["k"]}], "tenants.0.name"),
    ([{"name": "a", "api_keys": ["k"], "priority": 1, "best_priority": 3}], "best_priority"),
    ([{"name": "a", "api_keys": ["k"], "quotas": {"requests_per_minit": 3}}], "tenants.0.quotas.requests_per_minit"),
])
def test_tenant_config_errors_name_the_key(tmp_path, tenants_yaml, message):
    import yaml

    from kvloom.cluster.config import ClusterConfigError, load_cluster_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants_yaml}))
    with pytest.raises(ClusterConfigError) as err:
        load_cluster_config(path)
    assert message in str(err.value)


def test_ready_multi_tenant_config_loads():
    from kvloom.cluster.app import build_app
    from kvloom.cluster.config import load_cluster_config

    config = load_cluster_config(Path(__file__).parent.parent / "configs" / "multi-tenant.yaml")
    assert [t.name for t in config.tenants] == ["interactive", "batch"] and config.router.policy == "priority+fair"
    build_app(config)


def test_build_app_ships_only_key_digests_and_priority_engines():
    from kvloom.cluster.app import build_app, tenancy_user_config

    config = ClusterConfig.model_validate({"tenants": [{"name": "a", "api_keys": ["sk-secret"]}],
                                           "admin_keys": ["sk-root"], "router": {"policy": "priority+fair"}})
    user_config = tenancy_user_config(config)
    assert "sk-secret" not in repr(user_config) and "sk-root" not in repr(user_config)
    assert user_config["tenants"][0]["api_keys"] == [key_digest("sk-secret")]
    replicas = build_app(config)._bound_deployment.init_args[0]
    assert replicas._bound_deployment.init_args[0]["scheduling_policy"] == "priority"
    fcfs = build_app(config.model_copy(update={"router": config.router.model_copy(update={"policy": "fcfs"})}))
    assert "scheduling_policy" not in fcfs._bound_deployment.init_args[0]._bound_deployment.init_args[0]
