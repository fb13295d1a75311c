"""Disaggregated prefill -> decode inside one process: the hand-off changes no token."""

import pytest

from kvloom.engine.kv_handoff import KVHeader, KVTransferError, export_kv, import_kv
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        done = [o for o in engine.step() if o.finished]
    return done[0].outputs[0]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    make = lambda: LLMEngine(model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=8 << 20)
    return make(), make(), make()


@pytest.mark.parametrize("prompt_len", [1, 4, 7, 33])
def test_prefill_then_decode_elsewhere_matches_one_engine(engines, prompt_len):
    colocated, prefill, decode = engines
    prompt = [(7 * i) % 500 + 3 for i in range(prompt_len)]
    expected = run(colocated, "c", prompt, GREEDY).token_ids

    request = prefill.make_request("p", prompt, GREEDY.model_copy(update={"max_tokens": 1}))
    request.park_kv = True
    prefill.add_prepared(request)
    while prefill.has_unfinished():
        first = prefill.step()
    header, payload = export_kv(prefill, "p")
    assert header.num_tokens == prompt_len and prefill.handoffs.parked("p") is not None

    header.check_matches(KVHeader.for_engine(decode, prompt_len))
    resumed = decode.make_request("d", prompt, GREEDY)
    assert import_kv(decode, resumed, first[0].outputs[0].token_ids[0], payload)
    prefill.release_parked("p")
    outputs = []
    while decode.has_unfinished():
        outputs.extend(o for o in decode.step() if o.finished)
    assert outputs[0].outputs[0].token_ids == expected
    for engine in engines:
        assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_mismatched_header_is_refused(engines):
    _, prefill, _ = engines
    theirs = KVHeader.for_engine(prefill, 10)
    with pytest.raises(KVTransferError, match="head_dim"):
        theirs.check_matches(KVHeader(**{**theirs.__dict__, "head_dim": theirs.head_dim * 2}))


def test_import_waits_when_the_batch_is_full(tiny_model_dir):
    decode = LLMEngine(model=str(tiny_model_dir), block_size=4, max_num_seqs=1, kv_cache_memory_bytes=8 << 20)
    decode.add_request("busy", [5, 6, 7], GREEDY)
    decode.step()
    resumed = decode.make_request("later", [5, 6, 7], GREEDY)
    payload = export_payload_like(decode, 3)
    assert not import_kv(decode, resumed, 9, payload)  # no room: nothing taken, caller retries
    assert decode.kv.num_held("later") == 0


def export_payload_like(engine, num_tokens):
    import torch

    return torch.zeros(KVHeader.for_engine(engine, num_tokens).payload_shape())
