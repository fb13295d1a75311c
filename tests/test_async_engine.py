"""AsyncLLMEngine streams tokens per request or many requests a step at a time, hands a consumer that fell
behind its backlog in one item, and a cancelled stream frees everything it held."""

import asyncio

import pytest

from kvloom.engine.async_engine import AsyncLLMEngine, FailedRequest, OutputBatches
from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

POOL = 1 << 24  # KV bytes: room for these prompts (the default 2 GiB costs an engine 1-7 s to fault in here)


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4,
                                        kv_cache_memory_bytes=POOL))
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id=None):
    outputs = [o async for o in engine.generate(prompt, params, request_id=request_id)]
    return outputs


async def assert_everything_freed(engine: AsyncLLMEngine) -> None:
    """Within 2 s (aborts reach the engine at its next step), nothing runs or waits and every block is free."""
    for _ in range(100):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
            break
        await asyncio.sleep(0.02)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


async def test_concurrent_streams_match_offline_engine(async_engine, tiny_model_dir):
    prompts = [[5, 6, 7], list(range(10, 60)), [300] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    streams = await asyncio.gather(*(collect(async_engine, p, params) for p in prompts))
    offline = LLMEngine(model=str(tiny_model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=POOL)
    for prompt, outputs in zip(prompts, streams):
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        streamed = [t for o in outputs for t in o.outputs[0].delta_token_ids]
        assert streamed == outputs[-1].outputs[0].token_ids
        offline.add_request("x", prompt, params)
        while offline.has_unfinished():
            done = [o for o in offline.step() if o.finished]
        assert done[0].outputs[0].token_ids == streamed


async def test_a_consumer_that_falls_behind_gets_its_backlog_in_one_item(async_engine):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = []
    async for output in async_engine.generate([5, 6, 7], params):
        outputs.append(output)
        await asyncio.sleep(0.05)  # slower than the tiny model's steps
    completion = outputs[-1].outputs[0]
    assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == completion.token_ids
    assert "".join(o.outputs[0].delta_text for o in outputs) == completion.text
    assert len(completion.token_ids) == 40 and len(outputs) < 20
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


async def test_cancelled_stream_aborts_and_frees_blocks(async_engine):
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    stream = async_engine.generate(list(range(3, 40)), params, request_id="cancel-me")
    await stream.__anext__()
    await stream.__anext__()
    await stream.aclose()
    await assert_everything_freed(async_engine)


async def test_bad_request_fails_alone_and_engine_keeps_serving(async_engine):
    with pytest.raises(InvalidRequestError, match="prompt"):
        await collect(async_engine, [], SamplingParams())
    outputs = await collect(async_engine, [7, 8, 9], SamplingParams(max_tokens=3, temperature=0))
    assert outputs[-1].finished
    async_engine.check_health()


async def test_output_batches_carry_many_requests_a_step_at_a_time(async_engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = {f"batch-{i}": list(range(5 + i, 20 + i)) for i in range(4)}
    alone = {rid: (await collect(async_engine, p, params))[-1].outputs[0].token_ids for rid, p in prompts.items()}
    batches = OutputBatches(async_engine)
    for rid, prompt in prompts.items():
        batches.add(async_engine.make_request(rid, prompt, params))
    streamed: dict[str, list[int]] = {rid: [] for rid in prompts}
    pulls = 0
    while batches.live:
        outputs = await batches.next_batch()
        pulls += 1
        assert len({o.request_id for o in outputs}) == len(outputs)  # one output per request per pull
        for output in outputs:
            streamed[output.request_id] += output.outputs[0].delta_token_ids
    assert streamed == alone
    assert pulls < sum(len(t) for t in alone.values()) / 2  # not one pull per request per step


async def test_closing_output_batches_aborts_their_requests_and_frees_blocks(async_engine):
    batches = OutputBatches(async_engine)
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    for i in range(3):
        batches.add(async_engine.make_request(f"closed-{i}", list(range(3, 30)), params))
    await batches.next_batch()
    batches.close()
    await assert_everything_freed(async_engine)


async def test_a_request_the_engine_refuses_fails_alone_in_its_batch(async_engine):
    """Refused on the engine thread (a continuation longer than its max_tokens): a FailedRequest in the batch;
    the request beside it runs to its end."""
    batches = OutputBatches(async_engine)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    batches.add(async_engine.make_request("fine", [7, 8, 9], params))
    refused = async_engine.make_request("refused", [7, 8, 9], params)
    batches.add(refused, start=lambda engine: engine.add_continued(refused, [5, 6, 7], 0))
    outcomes = {}
    while batches.live:
        outcomes.update((o.request_id, o) for o in await batches.next_batch())
    assert isinstance(outcomes["refused"], FailedRequest) and "max_tokens is 3" in str(outcomes["refused"].error)
    assert outcomes["fine"].finished and len(outcomes["fine"].outputs[0].token_ids) == 3
    await assert_everything_freed(async_engine)


async def test_an_id_still_streaming_is_refused_at_once_and_the_first_runs_on(async_engine):
    """The twin is refused before anything is queued: it neither takes over the first one's outputs nor,
    when its own batch closes, aborts it."""
    first, twins = OutputBatches(async_engine), OutputBatches(async_engine)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first.add(async_engine.make_request("twice", [7, 8, 9], params))
    with pytest.raises(InvalidRequestError, match="request_id: 'twice' is already running"):
        twins.add(async_engine.make_request("twice", [7, 8, 9], params))
    with pytest.raises(InvalidRequestError, match="already running"):
        await collect(async_engine, [7, 8, 9], params, request_id="twice")
    twins.close()
    tokens = []
    while first.live:
        tokens += [t for o in await first.next_batch() for t in o.outputs[0].delta_token_ids]
    assert len(tokens) == 20
    await assert_everything_freed(async_engine)


def test_an_async_engine_warms_up_before_it_takes_requests(tiny_model_dir):
    """The first user request does not pay for what starts lazily: one short request ran at start (a fresh
    engine, nothing sent to it, whose requests may be only 8 tokens long), and left every block free."""
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4, max_model_len=8,
                                        kv_cache_memory_bytes=POOL))
    try:
        stats = engine.stats()
        assert stats.num_steps >= 1
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        engine.shutdown()
