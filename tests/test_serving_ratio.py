"""The serving-ratio benchmark judges `kvloom serve` against its offline engine by the median of alternated
rounds, and splits the difference: the engine hosted as a Serve replica (a driver calling the replica straight,
tested here on a real deployment) and the HTTP path in front of it."""

import asyncio

import pytest

from kvloom.benchmarks.harness import BenchSettings
from kvloom.benchmarks.studies.replica_replay import cluster_address, replay_replica
from kvloom.benchmarks.serving_cpu import ENGINE_THREADS
from kvloom.benchmarks.studies.serving_ratio import median_ratio, report
from kvloom.benchmarks.workloads import Workload, WorkloadRequest


def run(tok_s: float, steps: int = 257, step_ms: float | None = 100.0, cpu: dict | None = None) -> dict:
    return {"output_tok_s": tok_s, "wall_s": 8885 / tok_s, "steps": steps, "step_ms": step_ms, "cpu_by_role": cpu}


SERVED_CPU = {ENGINE_THREADS: 50.0, "router": 2.0, "Serve proxy": 0.3}


def test_each_ratio_is_the_median_over_the_rounds_where_both_runs_ran():
    rows = [{"offline": run(400.0), "replica": run(392.0), "served": run(380.0)},  # 0.98, 0.95
            {"offline": run(400.0), "replica": run(372.0), "served": run(320.0)},  # 0.93, 0.80
            {"offline": run(400.0), "replica": None, "served": run(360.0)},  # -, 0.90
            {"offline": None, "replica": run(380.0), "served": run(390.0)}]  # the offline run failed: no ratio
    assert median_ratio(rows) == 0.9
    assert median_ratio(rows, "replica") == pytest.approx(0.955)
    assert median_ratio([{"offline": run(400.0), "replica": None, "served": None}]) is None


def test_the_report_shows_every_round_both_medians_and_whose_cpu_the_served_runs_used():
    replica_cpu = {ENGINE_THREADS: 47.0, "router": 0.4}
    rows = [{"offline": run(360.0, step_ms=95.3), "replica": run(342.0, 260, 98.0, replica_cpu),
             "served": run(315.0, 264, 106.3, SERVED_CPU)},
            {"offline": run(350.0), "replica": None, "served": None}]
    text = report(rows, "AMD EPYC [avx2]", BenchSettings())
    assert "| 0 | 360.0 | 257, 95.3 | 342.0 | 260, 98.0 | 315.0 | 264, 106.3 | 0.950 | 0.875 | 2.30 |" in text
    assert "| 1 | 350.0 | 257, 100.0 | failed | – | failed | – | – | – | – |" in text
    assert ("Median over HTTP / offline: **0.875** (goal >= 0.9: **missed by 3%**); straight to the replica / "
            "offline: 0.950.") in text
    assert "round 0, straight to the replica: CPU during the run: engine threads 47.0 s; beside them 0.40 s" in text
    assert ("round 0, over HTTP: CPU during the run: engine threads 50.0 s; beside them 2.30 s (router 2.00, Serve "
            "proxy 0.30)") in text


def test_no_round_that_ran_both_is_not_measured_rather_than_met():
    text = report([{"offline": None, "replica": None, "served": None}], "cpu", BenchSettings())
    assert "goal >= 0.9: **not measured**" in text


def test_the_driver_finds_the_cluster_in_what_kvloom_serve_prints():
    log = ("deploying smollm2 from serve.yaml ...\n"
           "  replicas and their ranks: kvloom status --address 192.0.2.2:40253\n")
    assert cluster_address(log) == "192.0.2.2:40253"
    assert cluster_address("deploying smollm2 from serve.yaml ...\n") is None


@pytest.mark.slow
def test_straight_to_the_replica_every_request_gets_its_greedy_tokens_each_timed(
        ray_serve, deploy_app, smollm2_4_layers_dir, smollm2_prompts, greedy_reference):
    """The driver makes the router's calls itself (submit, one output channel): the float32 replica's greedy
    tokens are transformers', every token has the time its step's message arrived, and the run's wall time
    runs from the first arrival to the last finish. (SmolLM2 cut to four layers: the driver is under test.)"""
    from ray import serve

    from kvloom.cluster.app import REPLICA_NAME
    from kvloom.cluster.config import ClusterConfig

    config = ClusterConfig.model_validate({
        "resources": {"num_cpus": 1, "torch_threads": 1},
        "engine": {"model": str(smollm2_4_layers_dir), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024,
                   "max_num_seqs": 8}})
    prompts = smollm2_prompts[-4:]
    deploy_app(config)  # the app every deploying test replaces: one app serves the route prefix "/"
    try:
        workload = Workload("w", [WorkloadRequest(f"r{i}", ids, 5 + i, arrival_s=0.05 * i)
                                  for i, ids in enumerate(prompts)])
        records, wall = asyncio.run(replay_replica(serve.get_deployment_handle(REPLICA_NAME, config.name), workload,
                                                   timeout_s=120))
    finally:
        serve.delete(config.name)
    reference = [tokens[: 5 + i] for i, tokens in enumerate(greedy_reference(smollm2_4_layers_dir, prompts, 8))]
    assert [r.output_token_ids for r in records] == reference
    for record in records:
        assert len(record.token_times) == len(record.output_token_ids)
        times = record.token_times
        assert record.arrival <= record.first_token == times[0] <= times[-1] == record.finished
    assert wall == pytest.approx(max(r.finished for r in records) - min(r.arrival for r in records))
