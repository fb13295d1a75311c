"""A flooding tenant's prompts yield: the router marks the requests of a tenant over its share among the tenants
active on a replica, and the engine computes their prompts in small chunks, and none in a step that computes
another tenant's prompt, so that prompt neither waits out a long step nor shares its own with the flood."""

import itertools
import time

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.scheduler import Scheduler, SchedulerLimits
from kvloom.replicas.messages import ReplicaStats
from kvloom.router.replica_table import ACTIVE_TENANT_S, ReplicaState

CHUNK = 8
PROMPTS = itertools.count(1)


def scheduler(chunked: bool = True, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerLimits(max_num_seqs, 512, chunked, "priority", yielding_prefill_tokens=CHUNK),
                     KVCacheManager(256, 4))


def add(sched: Scheduler, rid: str, prompt_len: int, yields: bool, priority: int = 1) -> Request:
    start = 1000 * next(PROMPTS)  # prompts share no prefix (a prefix-cache hit would shorten a prefill)
    request = Request(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=5, ignore_eos=True),
                      priority=priority, yields_prefill=yields)
    sched.add_request(request)
    return request


def step(sched: Scheduler) -> dict[str, int]:
    """One step with a dummy model: what each request computed in it."""
    out = sched.schedule()
    done = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
    for request in sched.update_from_output(out, {r.request_id: [7] for r in done}):
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
    return {r.request_id: n for r, n in out.scheduled}


def test_a_yielding_prompt_goes_in_chunks_and_its_decodes_are_untouched():
    sched = scheduler()
    flood = add(sched, "a", 30, yields=True)
    assert [step(sched)["a"] for _ in range(4)] == [CHUNK, CHUNK, CHUNK, 30 - 3 * CHUNK]
    assert flood.num_output_tokens == 1
    assert step(sched) == {"a": 1}


def test_another_tenants_prompt_gets_a_step_without_the_floods_prompt_tokens():
    sched = scheduler()
    decoding = add(sched, "a-running", 4, yields=True)
    step(sched)
    assert decoding.num_output_tokens == 1
    add(sched, "a-new", 40, yields=True)
    assert step(sched) == {"a-running": 1, "a-new": CHUNK}
    add(sched, "b", 32, yields=False, priority=0)  # arrives while the flood's prompt is half computed
    assert step(sched) == {"a-running": 1, "b": 32}  # the flood decodes on; its prompt waits this step
    assert step(sched) == {"a-running": 1, "b": 1, "a-new": CHUNK}


def test_a_non_yielding_request_that_cannot_start_does_not_stall_the_flood():
    sched = scheduler(max_num_seqs=1)
    flood = add(sched, "a", 30, yields=True, priority=0)
    step(sched)
    add(sched, "b", 8, yields=False, priority=1)  # worse class: it waits for the slot, not preempting
    assert step(sched) == {"a": CHUNK}
    while not flood.is_finished:
        step(sched)
    assert step(sched) == {"b": 8}


def test_without_chunked_prefill_a_prompt_is_computed_whole_yielding_or_not():
    sched = scheduler(chunked=False)
    add(sched, "a", 30, yields=True)
    assert step(sched) == {"a": 30}


def replica(max_num_seqs: int = 4) -> ReplicaState:
    return ReplicaState("r", ReplicaStats("r", max_num_seqs=max_num_seqs), time.monotonic())


def test_a_tenant_over_its_share_among_those_active_lately_crowds_and_one_alone_never_does():
    state, now = replica(), time.monotonic()
    for _ in range(4):
        assert not state.crowds(0, "a", 1.0, now)  # alone on the replica: every slot is its share
        state.tenants["a"] += 1
        state.recent["a"] = (1.0, now)
    state.recent["b"] = (1.0, now - 1.0)  # b's last request ended a second ago
    assert state.crowds(0, "a", 1.0, now)  # a holds 4 of 4 slots; its share among a and b is 2
    assert not state.crowds(0, "b", 1.0, now)
    assert not state.crowds(0, "a", 1.0, now + ACTIVE_TENANT_S)  # b has not been seen for a while
    assert state.crowds(0, "a", 3.0, now)  # weight 3 to b's 1: its share is 3 slots, and it asks for a 5th
    state.tenants["a"] = 1
    assert not state.crowds(0, "a", 1.0, now)  # its second slot: within its share of 2
    for name in "cdefgh":
        state.recent[name] = (1.0, now)
    state.tenants["a"] = 0
    assert not state.crowds(0, "a", 1.0, now)  # eight tenants, four slots: a first request still goes unhindered
