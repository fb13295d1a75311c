"""The KV tiers benchmark's bookkeeping on hand-made inputs: which replica served a request (from the router's
request counters), and (b)'s and (c)'s summaries. The runs themselves (`python -m kvloom.benchmarks.kv_tiers`) take
minutes: not unit tests."""

import pytest

from kvloom.benchmarks.kv_tiers_workload import Prose, chat_tokens, encoder, tier_setups
from kvloom.benchmarks.kv_tiers_serve import finished_requests, served_by, summary_b, summary_c

METRICS = """# HELP kvloom:requests_total Finished requests
kvloom:requests_total{finish_reason="length",lora="",replica="r1",tenant="c0"} 2.0
kvloom:requests_total{finish_reason="length",lora="",replica="r2",tenant="c1"} 1.0
kvloom:requests_total{finish_reason="abort",lora="",replica="r1",tenant="c1"} 1.0
kvloom:requests_created{finish_reason="length",lora="",replica="r1",tenant="c0"} 1.7e9
"""


def test_the_replica_a_request_finished_on_is_the_one_whose_count_for_its_tenant_grew():
    before = finished_requests(METRICS)
    assert before["c0", "r1"] == 2 and before["c1", "r2"] == 1 and before["c1", "r1"] == 1
    after = finished_requests(METRICS.replace('tenant="c0"} 2.0', 'tenant="c0"} 3.0') +
                              'kvloom:requests_total{finish_reason="length",lora="",replica="r2",tenant="c2"} 1.0\n')
    assert served_by(before, after, "c0") == "r1" and served_by(before, after, "c2") == "r2"
    with pytest.raises(RuntimeError, match="no replica"):
        served_by(before, after, "c1")


def probe(phase: str, replica: str, ttft: float) -> dict:
    return {"phase": phase, "prefix": 0, "replica": replica, "ttft_s": ttft}


def test_b_compares_the_overflow_replica_with_the_holders_pool_hits_and_leaves_misrouted_requests_out():
    run = {"holder": "h", "overflow": "o",
           "probes": [probe("computed", "h", 1.0), probe("holder", "h", 0.2), probe("holder", "h", 0.4),
                      probe("overflow", "o", 0.45), probe("overflow", "h", 9.0)]}
    summary = summary_b(run)
    assert summary["computed_p50_s"] == 1.0 and summary["holder_p50_s"] == pytest.approx(0.3)
    assert summary["overflow_over_holder"] == pytest.approx(1.5) and summary["misrouted"] == 1


def request(wave: float, replica: str, ttft: float) -> dict:
    return {"turn": int(wave), "wave_start_s": wave, "conversation": 0, "ttft_s": ttft, "replica": replica}


def test_c_compares_the_replicas_from_the_wave_where_the_new_one_took_its_first_request():
    run = {"first": "a", "records": [request(0, "a", 9.0), request(1, "a", 0.2), request(1, "b", 0.5),
                                     request(2, "a", 0.4), request(2, "b", 0.3)]}
    summary = summary_c(run)
    assert (summary["joined"], summary["joined_turn"], summary["first_requests"]) == ("b", 1, 2)
    assert summary["joining_first_wave_p50_s"] == 0.5 and summary["joining_over_first"] == pytest.approx(4 / 3)
    assert summary_c({"first": "a", "records": [request(0, "a", 1.0)]}) == {"joined": None}


def test_every_setup_gets_its_tiers_and_the_tiny_models_prompts_are_its_word_ids():
    setups = tier_setups("/dev/shm/h", "/tmp/d", 800)
    assert setups["tiers off"] is None and setups["host tier"] == {"host_bytes": 800, "host_path": "/dev/shm/h"}
    assert setups["host + disk"]["host_bytes"] == 100 and setups["host + disk"]["disk"]["bytes"] == 800
    chat = chat_tokens(Prose(encoder("tiny"), seed=0), 64, conversations=3, turns=2)
    assert len(chat.system) == 64 and chat.turns == 2 and len(chat.questions) == 3
    assert all(3 <= t < 512 for t in chat.system + chat.questions[2][1])
    again = chat_tokens(Prose(encoder("tiny"), seed=0), 64, conversations=3, turns=2)
    assert again == chat  # seeded: every setup, and vLLM, get the same prompts
