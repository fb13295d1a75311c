"""Sweep one engine knob (e.g. max_num_seqs) to draw the throughput-vs-latency trade-off curve, and
pick the setting with the most throughput whose p99 TPOT stays within a budget."""

from kvloom.benchmarks.harness import SystemSpec
from kvloom.benchmarks.run_results import metric
from kvloom.engine.config import EngineConfig


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`max_num_seqs=1,4,16` -> ("max_num_seqs", [1, 4, 16]); the knob must be an integer EngineConfig field."""
    param, _, values = text.partition("=")
    field = EngineConfig.model_fields.get(param)
    if field is None or field.annotation is not int or not values:
        knobs = [k for k, f in EngineConfig.model_fields.items() if f.annotation is int]
        raise ValueError(f"--sweep wants KNOB=V1,V2,... with KNOB one of {knobs}, got {text!r}")
    return param, [int(v) for v in values.split(",")]


def sweep_systems(param: str, values: list[int], strategy: str = "continuous") -> list[SystemSpec]:
    return [SystemSpec(f"{param}={v}", "kvloom", strategy=strategy, engine={param: v}) for v in values]


def summarize_sweep(run: dict, param: str, values: list[int], tpot_budget_s: float) -> dict:
    points = []
    for value in values:
        name = f"{param}={value}"
        points.append({"value": value, "output_tok_s": metric(run, name, "output_tok_s"),
                       "tpot_p99_s": metric(run, name, "tpot.p99"), "ttft_p99_s": metric(run, name, "ttft.p99"),
                       "mean_batch_size": metric(run, name, "mean_batch_size")})
    within = [p for p in points if p["output_tok_s"] and p["tpot_p99_s"] is not None
              and p["tpot_p99_s"] <= tpot_budget_s]
    best = max(within, key=lambda p: p["output_tok_s"], default=None)
    return {"label": run["label"], "param": param, "tpot_budget_s": tpot_budget_s, "points": points, "best": best,
            "num_requests": run["num_requests"] if param == "max_num_seqs" else None}
