"""KV memory on a real run: blocks are taken as tokens arrive, never reserved for max length."""

import random

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams


def test_peak_blocks_never_exceed_what_live_requests_hold(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), block_size=4, max_num_seqs=6, enable_prefix_caching=False,
                       kv_cache_memory_bytes=4 << 20)
    rng = random.Random(3)
    for i in range(10):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0))
    schedule = engine.scheduler.schedule
    bounds = []

    def schedule_and_check():
        out = schedule()
        # live requests need ceil(tokens / block_size) blocks for the tokens they hold after this step
        live = sum(-(-(r.num_computed_tokens + n) // 4) for r, n in out.scheduled)
        assert engine.kv.pool.num_used <= live, f"{engine.kv.pool.num_used} blocks in use, live need {live}"
        bounds.append(live)
        return out

    engine.scheduler.schedule = schedule_and_check
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert 0 < stats.peak_used_blocks <= max(bounds)
    assert stats.num_free_blocks == stats.num_blocks  # everything returned at the end
