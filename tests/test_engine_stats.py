"""The engine counts its steps, the requests computed in them and the seconds they took: the figures a
replica exports (`kvloom:engine_*` in /metrics), from which mean batch and how busy the engine was follow."""

import time

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

POOL = 1 << 24  # KV bytes: room for these prompts (the default 2 GiB costs an engine 1-7 s to fault in here)


def test_steps_requests_and_seconds_are_counted_and_an_idle_step_counts_nothing(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=POOL)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * 8, params)
    started = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.monotonic() - started
    stats = engine.stats()
    assert stats.num_steps == 5  # the prompts' step brings each request's first token, then 4 decode steps
    assert stats.mean_batch_size == 3
    assert 0 < stats.step_seconds <= elapsed
    assert engine.step() == []
    idle = engine.stats()
    assert (idle.num_steps, idle.step_seconds) == (stats.num_steps, stats.step_seconds)
