"""Scheduling semantics of each batching strategy, driven step by step without a model."""

import time

import pytest

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.scheduler import Scheduler, SchedulerLimits


def make_scheduler(batching: str, max_num_seqs: int = 4, **extra) -> Scheduler:
    limits = SchedulerLimits(max_num_seqs, 4096, True, "fcfs", batching, **extra)
    return Scheduler(limits, KVCacheManager(num_blocks=512, block_size=16))


def request(name: str, prompt_len: int, max_tokens: int, arrival: float | None = None) -> Request:
    return Request(name, [7] * prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0),
                   arrival_time=time.monotonic() if arrival is None else arrival)


def step(scheduler: Scheduler) -> list[str]:
    """One step with a pretend model; finishes requests at max_tokens. Returns who ran."""
    out = scheduler.schedule()
    advanced = scheduler.update_from_output(out, {r.request_id: [1] for r, _ in out.scheduled})
    for r in advanced:
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            scheduler.finish_request(r, RequestStatus.FINISHED_LENGTH)
    return [r.request_id for r, _ in out.scheduled]


def test_static_admits_nobody_until_the_whole_batch_finishes():
    s = make_scheduler("static", max_num_seqs=2)
    for r in (request("a", 10, 2), request("b", 30, 6), request("late", 10, 1)):
        s.add_request(r)
    ran = [step(s) for _ in range(6)]
    assert all("late" not in names for names in ran[:6])  # "a" finished after 2 steps, its slot stays idle
    assert step(s) == ["late"]
    assert s.counters.idle_slot_steps > 0
    assert s.batching.padding_tokens == 20  # "a" padded to "b"'s 30-token prompt


def test_dynamic_groups_by_length_bucket():
    s = make_scheduler("dynamic", max_num_seqs=2, bucket_width=64, max_wait_s=60.0)
    for r in (request("short1", 10, 1), request("long1", 200, 1), request("short2", 20, 1), request("long2", 210, 1)):
        s.add_request(r)
    assert sorted(step(s)) == ["short1", "short2"]  # the first full bucket
    assert sorted(step(s)) == ["long1", "long2"]


def test_dynamic_starts_a_partial_bucket_after_max_wait():
    s = make_scheduler("dynamic", max_num_seqs=4, bucket_width=64, max_wait_s=0.05)
    s.add_request(request("lonely", 10, 1))
    assert step(s) == []  # bucket not full, not waited long enough
    time.sleep(0.06)
    assert step(s) == ["lonely"]


def test_continuous_admits_as_soon_as_a_slot_frees():
    s = make_scheduler("continuous", max_num_seqs=2)
    for r in (request("a", 10, 1), request("b", 10, 5), request("c", 10, 3)):
        s.add_request(r)
    assert sorted(step(s)) == ["a", "b"]  # "a" finishes at once
    assert sorted(step(s)) == ["b", "c"]  # "c" takes the freed slot the very next step
    assert s.counters.idle_slot_steps == 0


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_batch_level_strategies_produce_the_same_tokens(tiny_model_dir, drive, batching):
    prompts = [[5 + i] * (4 + 9 * i) for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0)
    settings = {"model": str(tiny_model_dir), "block_size": 4, "kv_cache_memory_bytes": 1 << 24}
    continuous = drive(LLMEngine(**settings), prompts, params)
    other = drive(LLMEngine(**settings, batching=batching, max_num_seqs=4, max_wait_ms=0), prompts, params)
    assert [o.outputs[0].token_ids for o in other] == [o.outputs[0].token_ids for o in continuous]
