"""The speculative-decoding study's goals and report, from made-up runs (the study itself runs in the
committed report, never here), and the acceptance figures every bench table shows."""

from kvloom.benchmarks.studies import speculation
from kvloom.benchmarks.metrics import acceptance
from kvloom.benchmarks.report import spec_cell

SPEC = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 30, "num_accepted_tokens_per_pos": [9, 8, 7, 6]}


def run(**systems: tuple[float, float]) -> dict:
    """A batch's run where each system has (output tok/s, TPOT p50 s)."""
    results = [{"spec": {"name": name}, "status": "ok",
                "metrics": {"output_tok_s": tok_s, "tpot": {"p50": tpot, "p99": tpot}, "ttft": {"p50": 1.0},
                            "spec_decode": SPEC if "+" in name else None}}
               for name, (tok_s, tpot) in systems.items()]
    return {"results": results, "num_requests": 6, "output_tokens": 600, "equality": {}}


def test_acceptance_is_accepted_over_drafted_and_tokens_per_verifying_step():
    assert acceptance(SPEC) == (0.75, 4.0)
    assert acceptance(None) is None and acceptance({**SPEC, "num_drafts": 0}) is None
    assert spec_cell({"spec_decode": SPEC}) == "75% / 4.00" and spec_cell({}) == "–"


def test_goals_read_the_right_systems_at_the_right_batches():
    runs = {1: run(kvloom=(20.0, 0.050), **{"kvloom+ngram": (45.0, 0.020), "kvloom+draft_model": (15.0, 0.06),
                                            "vllm+ngram": (30.0, 0.03)}),
            16: run(kvloom=(200.0, 0.07), **{"kvloom+ngram": (190.0, 0.08), "vllm+ngram": (195.0, 0.08)}),
            64: run(kvloom=(300.0, 0.2), **{"kvloom+ngram": (290.0, 0.2)})}
    tpot, switch, batch_1, batch_16 = speculation.goals(runs)
    assert tpot[1:] == ("50.0 -> 20.0 ms (2.50x)", True)
    assert switch[2] is False  # 3.3% slower
    assert batch_1[1:] == ("kvloom+ngram 45.0 vs 30.0 (1.50x)", True)
    assert batch_16[2] is False  # the best kvloom system is slower than vLLM's


def test_a_missing_batch_is_reported_unmeasured_not_met(tmp_path):
    runs = {1: run(kvloom=(20.0, 0.05), **{"kvloom+ngram": (45.0, 0.02)})}
    rows = speculation.goals(runs)
    assert [met for _, _, met in rows] == [True, None, None, None]
    assert all(measured == "not measured" for _, measured, _ in rows[1:])
    doc = {"environment": {"host": "h", "cpus": 2, "torch": "t", "transformers": "x", "threads": 2,
                           "omp_wait_policy": "default",
                           "settings": {"max_num_seqs": 1, "max_num_batched_tokens": 2048,
                                        "kv_cache_memory_bytes": 2 << 30, "enable_prefix_caching": True,
                                        "timeout_s": 600, "hf_cb_attention": "sdpa"}},
           "dtype": "float32", "runs": {"1": runs[1]}, "wall_s": 60.0,
           "phases": [{"batch": 1, "steps": 3, "acceptance_rate": 0.8, "mean_acceptance_length": 4.2,
                       "ms_per_step": dict.fromkeys(("propose", "schedule", "forward", "lm_head", "verify", "rest",
                                                     "step"), 1.0)}]}
    text = speculation.write_report(doc, tmp_path).read_text()
    assert "| kvloom+ngram | 45.0 | 2.25x | 20 / 20 |" in text and "75% / 4.00" in text
    assert "| 1 | 3 | 1.00 |" in text and (tmp_path / "speculation.json").exists()
