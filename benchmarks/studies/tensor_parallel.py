"""Where a tensor-parallel decode step's time goes on this host, and what its communication would cost over NVLink.

SmolLM2 on 1 rank (every core) and on 2 ranks (the cores split between them, gloo between them), decode steps at
batch 1, 16 and 64 (128-token prompts). Rank 0 times each kind of collective it waits in (`TensorParallelGroup`
keeps the seconds, calls and bytes): the all-reduces after each attention and MLP block (and the embedding's),
the LM head's logits gather, the step plan's broadcast; the rest of the step is compute (and Python). From the
measured calls and bytes it predicts the same collectives under NCCL on NVLink, with the arithmetic shown.

Run: `python -m kvloom.benchmarks.studies.tensor_parallel` (a few minutes on 2 cores); writes
`benchmarks/results/tensor-parallel.{md,json}`.
"""

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.host_isa import host_isa
from kvloom.kernels.item_pool import intra_op_threads

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
BATCHES = (1, 16, 64)
PROMPT_LEN = 128
STEPS = 20
# H100 SXM: NVLink 4 carries 900 GB/s per GPU, 450 GB/s each way; NCCL's small-message all-reduce inside one
# NVLink node takes on the order of 10 us whatever the size (its latency floor): stated, not measured here
NVLINK_BYTES_PER_S = 450e9
NCCL_LATENCY_S = 10e-6
OPERATIONS = {"all-reduce": "all-reduce", "logits gather": "logits gather",
              "step plan": ("step plan header", "step plan")}


def collective_totals(engine: LLMEngine) -> dict[str, tuple[float, int, int]]:
    """(seconds, calls, bytes) so far per reported operation on rank 0; zeros with one rank."""
    group = getattr(engine.runner, "group", None)
    totals = {}
    for name, keys in OPERATIONS.items():
        keys = (keys,) if isinstance(keys, str) else keys
        totals[name] = tuple(sum(getattr(group, field).get(k, 0) if group else 0 for k in keys)
                             for field in ("seconds", "calls", "bytes"))
    return totals


def measure(engine: LLMEngine, batch: int, seed: int) -> dict:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=STEPS + 8, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)], params)
    while any(not engine.requests[r].output_token_ids for r in ids):  # prefills done: only decode steps next
        engine.step()
    for _ in range(2):  # oneDNN builds its primitives for a new row count on first use
        engine.step()
    before, started = collective_totals(engine), time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    step_s = (time.perf_counter() - started) / STEPS
    after = collective_totals(engine)
    for request_id in ids:
        engine.abort(request_id)
    split = {name: {"ms": (after[name][0] - before[name][0]) / STEPS * 1e3,
                    "calls": (after[name][1] - before[name][1]) / STEPS,
                    "bytes": (after[name][2] - before[name][2]) / STEPS} for name in OPERATIONS}
    compute_ms = step_s * 1e3 - sum(s["ms"] for s in split.values())
    return {"batch": batch, "step_ms": step_s * 1e3, "compute_ms": compute_ms, "collectives": split}


def predict_nvlink(row: dict, ranks: int) -> dict:
    """Each collective's time under NCCL on NVLink: per call, the latency floor plus the bytes each GPU sends over
    the link (ring all-reduce: 2(N-1)/N of the buffer; gather and broadcast: the root moves (N-1) buffers)."""
    factor = {"all-reduce": 2 * (ranks - 1) / ranks, "logits gather": ranks - 1, "step plan": ranks - 1}
    predicted = {}
    for name, measured in row["collectives"].items():
        calls = measured["calls"]
        per_call = measured["bytes"] / calls if calls else 0
        seconds = calls * (NCCL_LATENCY_S + factor[name] * per_call / NVLINK_BYTES_PER_S)
        predicted[name] = {"calls": calls, "bytes_per_call": per_call, "ms": seconds * 1e3,
                           "arithmetic": f"{calls:g} x ({NCCL_LATENCY_S * 1e6:g} us + {factor[name]:g} x "
                                         f"{per_call / 1e3:.1f} KB / {NVLINK_BYTES_PER_S / 1e9:g} GB/s)"}
    return predicted


def run(ranks_list: list[int], dtype: str) -> list[dict]:
    rows = []
    for ranks in ranks_list:
        engine = LLMEngine(dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30,
                           tensor_parallel_size=ranks)
        threads = getattr(engine.runner, "num_threads", intra_op_threads())
        for batch in BATCHES:
            row = {"ranks": ranks, "threads_per_rank": threads, "dtype": str(engine.dtype).removeprefix("torch."),
                   **measure(engine, batch, seed=batch)}
            if ranks > 1:
                row["nvlink"] = predict_nvlink(row, ranks)
            rows.append(row)
            print(f"[tp] ranks {ranks} batch {batch:>2}: step {row['step_ms']:.1f} ms, compute "
                  f"{row['compute_ms']:.1f} ms", flush=True)
        engine.shutdown()
    return rows


def reading(rows: list[dict]) -> str:
    """What the measured split says, in numbers."""
    single = {r["batch"]: r for r in rows if r["ranks"] == 1}
    parts = []
    for row in (r for r in rows if r["ranks"] > 1):
        talk = sum(v["ms"] for v in row["collectives"].values())
        one = single[row["batch"]]
        predicted = sum(v["ms"] for v in row["nvlink"].values())
        parts.append(f"batch {row['batch']}: {row['ranks']} ranks take {row['step_ms']:.1f} ms a step against "
                     f"{one['step_ms']:.1f} on one, {talk / row['step_ms']:.0%} of it in collectives "
                     f"({talk:.1f} ms; {predicted:.2f} ms predicted on NVLink), compute {row['compute_ms']:.1f} ms "
                     f"on half the cores")
    return "Measured: " + "; ".join(parts) + "."


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor-parallel.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Tensor parallelism: the per-step cost split",
        "",
        f"Host: {meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}; SmolLM2-135M, dtype {meta['dtype']}, "
        f"decode steps of {PROMPT_LEN}-token prompts, mean of {STEPS} steps, measured on rank 0. One rank uses every "
        "core; with 2 ranks each has half of them, and gloo carries the collectives over loopback TCP.",
        "Regenerate: `python -m kvloom.benchmarks.studies.tensor_parallel`.",
        "",
        "| ranks | threads/rank | batch | step ms | compute ms | all-reduce ms (calls, KB each) | logits gather ms (KB) "
        "| step plan ms (bytes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["collectives"]
        ar, gather, plan = c["all-reduce"], c["logits gather"], c["step plan"]
        per_call = ar["bytes"] / ar["calls"] / 1e3 if ar["calls"] else 0
        lines.append(f"| {row['ranks']} | {row['threads_per_rank']} | {row['batch']} | {row['step_ms']:.1f} | "
                     f"{row['compute_ms']:.1f} | {ar['ms']:.1f} ({ar['calls']:g}, {per_call:.1f}) | "
                     f"{gather['ms']:.1f} ({gather['bytes'] / 1e3:.0f}) | {plan['ms']:.2f} ({plan['bytes']:.0f}) |")
    lines += ["", "## The same collectives under NCCL on NVLink (predicted)", "",
              f"Assumed: {NVLINK_BYTES_PER_S / 1e9:g} GB/s each way per GPU (H100 SXM, NVLink 4) and a "
              f"{NCCL_LATENCY_S * 1e6:g} us floor per NCCL call inside one node. Calls and bytes are the measured "
              "ones above (float32 partial sums: the all-reduce carries 4 bytes per hidden value).", "",
              "| batch | all-reduce: calls x (latency + link bytes / bandwidth) | ms | logits gather ms | step plan ms "
              "| all on NVLink ms | measured here (gloo) ms |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "nvlink" not in row:
            continue
        p = row["nvlink"]
        total = sum(v["ms"] for v in p.values())
        measured = sum(v["ms"] for v in row["collectives"].values())
        lines.append(f"| {row['batch']} | {p['all-reduce']['arithmetic']} | {p['all-reduce']['ms']:.3f} | "
                     f"{p['logits gather']['ms']:.3f} | {p['step plan']['ms']:.3f} | {total:.2f} | {measured:.1f} |")
    lines += ["", reading(rows), ""]
    (out / "tensor-parallel.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    rows = run([1, 2], args.dtype)
    meta = {"cpu": host_isa().describe(), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "dtype": rows[0]["dtype"], "python": platform.python_version()}
    write_report(rows, meta, args.out)
    print(f"report: {args.out / 'tensor-parallel.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
