"""One benchmark: a saved workload replayed by several systems, their outputs cross-checked.

The result is a JSON-ready dict (what `report` renders), so a report can be re-rendered from a
saved run without running anything again.
"""

import multiprocessing
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from kvloom.benchmarks.external_peers import KINDS as EXTERNAL_KINDS
from kvloom.benchmarks.external_peers import external_systems, run_external, vllm_env
from kvloom.benchmarks.harness import BenchSettings, SystemResult, SystemSpec, run_isolated
from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.strategies import STRATEGIES
from kvloom.benchmarks.workloads import Workload
from kvloom.kernels.host_isa import auto_cpu_dtype, host_isa

DEFAULT_STRATEGIES = list(STRATEGIES)
DEFAULT_PEERS = ["hf-static", "hf-cb"]
KNOWN_PEERS = [*DEFAULT_PEERS, *EXTERNAL_KINDS]
DEFAULT_HF_BATCHES = (8, 16, 32)
REFERENCE = "continuous"  # the system others are compared with (outputs, roofline, goals)
RESERVE_S = 60.0  # under a time budget, what each system still to come is guaranteed


def make_systems(strategies: list[str], peers: list[str], hf_batch_sizes=DEFAULT_HF_BATCHES,
                 hf_static_batches: int | None = None, peer_requests: int | None = None,
                 speculative_config: dict | None = None) -> list[SystemSpec]:
    """kvloom's reference strategy, the peers, then the other strategies; with `speculative_config`, every
    kvloom engine and vLLM's offline engine speculate with it (the HTTP peers and HF do not).

    Peers are slow on CPU; to fit a time budget they may replay a stated prefix of the workload:
    hf-static-B the first `hf_static_batches` x B requests (whole batches), hf-cb the first
    `peer_requests`. None runs the whole workload.
    """
    unknown = [s for s in strategies if s not in STRATEGIES] + [p for p in peers if p not in KNOWN_PEERS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; strategies: {list(STRATEGIES)}, peers: {KNOWN_PEERS}")
    kvloom = [SystemSpec(s, "kvloom", strategy=s) for s in strategies]
    others = []
    if "hf-cb" in peers:
        others.append(SystemSpec("hf-cb", "hf-cb", num_requests=peer_requests))
    if "hf-static" in peers:
        others += [SystemSpec(f"hf-static-{b}", "hf-static", batch_size=b,
                              num_requests=hf_static_batches and hf_static_batches * b) for b in hf_batch_sizes]
    others += external_systems([p for p in peers if p in EXTERNAL_KINDS])
    # Under a time budget, what runs first is what is sure to finish: the reference, then the peers.
    ordered = [s for s in kvloom if s.name == REFERENCE] + others + [s for s in kvloom if s.name != REFERENCE]
    if speculative_config:
        ordered = [replace(s, engine={**s.engine, "speculative_config": speculative_config})
                   if s.kind in ("kvloom", "vllm") else s for s in ordered]
    return ordered


def compare_outputs(results: list[SystemResult]) -> dict[str, dict]:
    """Greedy outputs of every system against kvloom continuous (else the first kvloom system, else the
    first system), on the requests both finished; a system pinned to a dtype is compared with the first kvloom
    system pinned to the same one where there is such (vLLM float32 against kvloom float32).

    fp32 sums in a different order (other batch shapes, padding) can flip a near-tie argmax, after
    which the texts diverge; so a mismatch is reported with where it starts, never hidden or fatal.
    """
    finished = [r for r in results if r.outputs]
    if not finished:
        return {}
    default = min(finished, key=lambda r: (r.spec.name != REFERENCE, r.spec.kind != "kvloom"))
    pinned = {}
    for r in finished:
        if r.spec.kind == "kvloom" and "dtype" in r.spec.engine:
            pinned.setdefault(r.spec.engine["dtype"], r)
    report = {}
    for result in finished:
        reference = pinned.get(result.spec.engine.get("dtype"), default) if result.spec.kind != "kvloom" else default
        if result is reference:
            continue
        common = [i for i in result.outputs if i in reference.outputs]
        mismatches = []
        for request_id in common:
            a, b = reference.outputs[request_id], result.outputs[request_id]
            if a != b:
                first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                mismatches.append({"id": request_id, "first_diff": first, "length": len(a)})
        report[result.spec.name] = {"reference": reference.spec.name, "compared": len(common),
                                    "equal": len(common) - len(mismatches), "mismatches": mismatches}
    return report


def environment(settings: BenchSettings) -> dict:
    import torch
    import transformers

    return {"host": platform.node(), "commit": source_commit(), "cpu": host_isa().describe(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": settings.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "default"),
            "auto_dtype": auto_cpu_dtype(host_isa()), "vllm_env": vllm_env(settings),
            "settings": asdict(settings)}


def run_systems(workload: Workload, systems: list[SystemSpec], settings: BenchSettings, out_dir: Path,
                label: str | None = None, budget_s: float | None = None) -> dict:
    """Replay `workload` (saved once as JSONL, so each system reads identical input) on every system.

    With `budget_s` the whole run stays within it: each system may use what is left minus a reserve of
    RESERVE_S for each system still to come, and one stopped at its limit keeps what it finished (flagged).
    """
    path = workload.save(out_dir / f"{workload.name}.jsonl")
    deadline = time.monotonic() + budget_s if budget_s else None
    results = []
    bar = tqdm(systems, desc=label or workload.name, unit="system", position=0)
    for i, spec in enumerate(bar):
        bar.set_postfix_str(spec.name)
        limit = settings.timeout_s
        if deadline is not None:
            left = len(systems) - i - 1
            limit = min(limit, max(deadline - time.monotonic() - RESERVE_S * left, RESERVE_S))
        run = run_external if spec.kind in EXTERNAL_KINDS else run_isolated
        result = run(spec, path, settings, out_dir / "systems" / spec.name, limit)
        m = result.metrics
        tqdm.write(f"  {spec.name:<20} {result.status:<8} "
                   + (f"{m.output_tok_s:7.1f} out tok/s  {m.num_requests} req  {m.wall_s:6.1f} s" if m else "")
                   + f"  ({result.elapsed_s:.0f} s with load)")
        results.append(result)
    return {"label": label or workload.name, "workload": workload.name, "params": workload.params,
            "num_requests": len(workload.requests), "output_tokens": workload.num_output_tokens,
            "budget_s": budget_s, "results": [asdict(r) for r in results], "equality": compare_outputs(results)}


def in_fresh_process(fn, *args):
    """Call `fn(*args)` in a spawned process (same threads and environment as the systems get)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
