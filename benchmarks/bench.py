"""One benchmark: a saved workload replayed by several systems, their outputs cross-checked.

The result is a JSON-ready dict (what `report` renders), so a report can be re-rendered from a
saved run without running anything again.
"""

import multiprocessing
import os
import platform
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from kvloom.benchmarks.harness import STRATEGIES, BenchSettings, SystemResult, SystemSpec, run_isolated
from kvloom.benchmarks.workloads import Workload

DEFAULT_STRATEGIES = list(STRATEGIES)
DEFAULT_PEERS = ["hf-static", "hf-cb"]
DEFAULT_HF_BATCHES = (8, 16, 32)
REFERENCE = "continuous"  # the system others are compared with (outputs, roofline, goals)


def make_systems(strategies: list[str], peers: list[str], hf_batch_sizes=DEFAULT_HF_BATCHES,
                 hf_static_batches: int | None = None, peer_requests: int | None = None) -> list[SystemSpec]:
    """kvloom strategies, then the peers.

    Peers are slow on CPU; to fit a time budget they may replay a stated prefix of the workload:
    hf-static-B the first `hf_static_batches` x B requests (whole batches), hf-cb the first
    `peer_requests`. None runs the whole workload.
    """
    unknown = [s for s in strategies if s not in STRATEGIES] + [p for p in peers if p not in DEFAULT_PEERS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; strategies: {list(STRATEGIES)}, peers: {DEFAULT_PEERS}")
    systems = [SystemSpec(s, "kvloom", strategy=s) for s in strategies]
    if "hf-static" in peers:
        systems += [SystemSpec(f"hf-static-{b}", "hf-static", batch_size=b,
                               num_requests=hf_static_batches and hf_static_batches * b) for b in hf_batch_sizes]
    if "hf-cb" in peers:
        systems.append(SystemSpec("hf-cb", "hf-cb", num_requests=peer_requests))
    return systems


def compare_outputs(results: list[SystemResult]) -> dict[str, dict]:
    """Greedy outputs of every system against kvloom continuous (else the first kvloom system, else the
    first system), on the requests both finished.

    fp32 sums in a different order (other batch shapes, padding) can flip a near-tie argmax, after
    which the texts diverge; so a mismatch is reported with where it starts, never hidden or fatal.
    """
    finished = [r for r in results if r.outputs]
    if not finished:
        return {}
    reference = min(finished, key=lambda r: (r.spec.name != REFERENCE, r.spec.kind != "kvloom"))
    report = {}
    for result in finished:
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

    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": settings.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "settings": asdict(settings)}


def run_systems(workload: Workload, systems: list[SystemSpec], settings: BenchSettings, out_dir: Path,
                label: str | None = None) -> dict:
    """Replay `workload` (saved once as JSONL, so each system reads identical input) on every system."""
    path = workload.save(out_dir / f"{workload.name}.jsonl")
    results = []
    bar = tqdm(systems, desc=label or workload.name, unit="system", position=0)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        result = run_isolated(spec, path, settings, out_dir / "systems" / spec.name)
        m = result.metrics
        tqdm.write(f"  {spec.name:<20} {result.status:<8} "
                   + (f"{m.output_tok_s:7.1f} out tok/s  {m.num_requests} req  {m.wall_s:6.1f} s" if m else "")
                   + f"  ({result.elapsed_s:.0f} s with load)")
        results.append(result)
    return {"label": label or workload.name, "workload": workload.name, "params": workload.params,
            "num_requests": len(workload.requests), "output_tokens": workload.num_output_tokens,
            "results": [asdict(r) for r in results], "equality": compare_outputs(results)}


def in_fresh_process(fn, *args):
    """Call `fn(*args)` in a spawned process (same threads and environment as the systems get)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
