"""`python -m kvloom.benchmarks.quantized`: each goal line is judged from the run's own figures, and a system that
did not finish is said to be unmeasured, never counted as holding."""

from kvloom.benchmarks import quantized


def run(**systems) -> dict:
    """One run's results: system name -> (TPOT p50 s, output tok/s), or None where it did not finish."""
    return {"results": [{"spec": {"name": name}, "metrics": None if figures is None else
                         {"tpot": {"p50": figures[0], "p99": figures[0]}, "output_tok_s": figures[1]}}
                        for name, figures in systems.items()]}


def report(llama_w1=(0.5, 100.0), w1_rounds=()) -> dict:
    single = run(**{"kvloom-dequantized": (0.012, 18), "kvloom-q4_1": (0.005, 18), "kvloom-serve-q4_1": (0.008, 18),
                    "llama.cpp-q4_1": (0.010, 18)})
    w1 = run(**{"kvloom-dequantized": (0.1, 400.0), "kvloom-q4_1": (0.1, 380.0), "kvloom-q4_1-int8": (0.1, 420.0),
                "kvloom-serve-q4_1": (0.1, 300.0), "llama.cpp-q4_1": llama_w1})
    return {"runs": [single, w1], "w1_rounds": list(w1_rounds), "floor": {"quantized_floor_ms": 4.0},
            "quality": {"float32": {"equal_share": 0.95, "perplexity": {"dequantized": 10.0, "q4_1": 10.1}},
                        "bfloat16": {"equal_share": 0.85, "perplexity": {"dequantized": 10.0, "q4_1": 10.04}},
                        "bfloat16, int8": {"equal_share": 0.7, "perplexity": {"dequantized": 10.0, "q4_1": 10.2}}}}


def test_each_goal_is_judged_from_the_figures_in_its_direction():
    lines = quantized.goals(report())
    assert lines == [
        "batch-1 TPOT over the quantized read floor: 1.25x (goal at most 1.3x): holds",
        "batch-1 TPOT, de-quantized over quantized: 2.40x (goal at least 2.0x): holds",
        "batch-1 TPOT over HTTP, llama.cpp over kvloom serve: 1.25x (goal at least 1.2x): holds",
        "W1 throughput over HTTP, kvloom serve over llama.cpp: 3.00x (goal at least 2.0x): holds",
        "W1 offline throughput, quantized over de-quantized (one pass each): 0.95x (goal at least 1.0x): missed",
        "W1 offline throughput, quantized with int8 activations over de-quantized (one pass each): 1.05x (goal at "
        "least 1.0x): holds",
        "float32: greedy tokens equal to the de-quantized engine's (share, as x): 0.95x (goal at least 0.9x): holds",
        "float32: perplexity, quantized over de-quantized: 1.01x (goal at most 1.005x): missed",
        "bfloat16: greedy tokens equal to the de-quantized engine's (share, as x): 0.85x (goal at least 0.9x): missed",
        "bfloat16: perplexity, quantized over de-quantized: 1.00x (goal at most 1.005x): holds",
        "bfloat16, int8: greedy tokens equal to the de-quantized engine's (share, as x): 0.70x (goal at least 0.9x): "
        "missed",
        "bfloat16, int8: perplexity, quantized over de-quantized: 1.02x (goal at most 1.005x): missed"]


def test_a_system_that_did_not_finish_leaves_its_goal_unmeasured():
    lines = quantized.goals(report(llama_w1=None))
    assert "W1 throughput over HTTP, kvloom serve over llama.cpp: not measured (a system did not finish)" in lines


def test_alternating_w1_rounds_judge_the_offline_ratios_by_their_median():
    """Each round's ratio is taken within the round (the host drifts between rounds), and their median judged."""
    rounds = [{"kvloom-dequantized": 400.0, "kvloom-q4_1": 410.0, "kvloom-q4_1-int8": 440.0},
              {"kvloom-dequantized": 300.0, "kvloom-q4_1": 297.0, "kvloom-q4_1-int8": 330.0},
              {"kvloom-dequantized": 420.0, "kvloom-q4_1": 428.4, "kvloom-q4_1-int8": None}]
    lines = quantized.goals(report(w1_rounds=rounds))
    assert "W1 offline throughput, quantized over de-quantized (median of 3 rounds): 1.02x (goal at least 1.0x): " \
           "holds" in lines
    assert "W1 offline throughput, quantized with int8 activations over de-quantized (median of 3 rounds): 1.10x " \
           "(goal at least 1.0x): holds" in lines
