"""The external peers' command lines and result parsing, checked without vLLM or llama.cpp installed (the
peers themselves run in the benchmark report, never here)."""

import json
import os
from pathlib import Path

import pytest
import yaml

from kvloom.benchmarks import external_peers as peers
from kvloom.benchmarks.bench import make_systems
from kvloom.benchmarks.harness import BenchSettings, SystemSpec
from kvloom.benchmarks.workloads import Workload, WorkloadRequest
from kvloom.cluster.config import ClusterConfig
from kvloom.kernels.host_isa import HostISA
from kvloom.replicas.messages import ReplicaStats
from kvloom.router.metrics import RouterMetrics
from kvloom.router.replica_table import ReplicaTable

SETTINGS = BenchSettings(threads=2, max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory_bytes=2 << 30)
WORKLOAD = Workload("w1", [WorkloadRequest("w1-0", [5, 6, 7], 4), WorkloadRequest("w1-1", [8, 9], 2)])


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_vllm_offline_runs_the_driver_in_vllms_own_python_with_the_shared_settings():
    command = peers.vllm_offline_command(Path("/venv/bin/python"), Path("w.jsonl"), Path("/m"), Path("o.json"),
                                         SETTINGS, "bfloat16", 768)
    assert command[0] == "/venv/bin/python" and command[1].endswith("peer_drivers/vllm_offline.py")
    assert command[2:5] == ["w.jsonl", "/m", "o.json"]
    assert (flag(command, "--dtype"), flag(command, "--max-num-seqs"), flag(command, "--max-num-batched-tokens"),
            flag(command, "--max-model-len"), flag(command, "--kv-cache-memory-bytes")) == (
        "bfloat16", "64", "2048", "768", str(2 << 30))
    assert "--no-prefix-caching" not in command
    no_cache = BenchSettings(enable_prefix_caching=False)
    assert "--no-prefix-caching" in peers.vllm_offline_command(Path("p"), Path("w"), Path("m"), Path("o"), no_cache,
                                                               "float32", 8)


def test_vllm_serve_is_started_as_its_module_on_loopback():
    command = peers.vllm_server_command(Path("/venv/bin/python"), Path("/m"), 8123, SETTINGS, "bfloat16", 768)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert (flag(command, "--host"), flag(command, "--port"), flag(command, "--model")) == ("127.0.0.1", "8123", "/m")
    assert flag(command, "--served-model-name") == peers.SERVED_NAME and flag(command, "--max-num-seqs") == "64"
    assert flag(command, "--kv-cache-memory-bytes") == str(2 << 30)


def test_vllm_runs_at_its_documented_best_with_the_same_kv_budget_in_bytes():
    """Every usable CPU bound to its engine, none reserved for its front end on a small host (its default binding
    would keep one of two back), passive OpenMP waits, and the libraries its guide preloads where they exist. The
    KV budget goes on the command line in bytes: vLLM reads `VLLM_CPU_KVCACHE_SPACE` as whole GiB."""
    assert peers.vllm_env(SETTINGS, cpus=[0, 1], preload=[]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    preloaded = peers.vllm_env(SETTINGS, cpus=[0, 1], preload=[Path("/lib/tcmalloc.so"), Path("/venv/lib/libiomp5.so")])
    assert preloaded["LD_PRELOAD"] == "/lib/tcmalloc.so:/venv/lib/libiomp5.so"
    odd = peers.vllm_engine_flags(BenchSettings(kv_cache_memory_bytes=233 << 20), "float32", 768)
    assert flag(odd, "--kv-cache-memory-bytes") == str(233 << 20)
    big = peers.vllm_env(SETTINGS, cpus=[*range(8), 10, 12, 13])
    assert big["VLLM_CPU_OMP_THREADS_BIND"] == "0-7,10,12-13" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in big
    assert peers.vllm_env(SETTINGS)["VLLM_CPU_OMP_THREADS_BIND"] == peers.cpu_list(sorted(os.sched_getaffinity(0)))


def test_llama_server_gets_one_slot_per_sequence_and_the_context_they_need():
    command = peers.llama_server_command(Path("/bin/llama-server"), Path("/g/m.gguf"), 9000, SETTINGS, 768)
    assert command[0] == "/bin/llama-server" and flag(command, "-m") == "/g/m.gguf"
    assert (flag(command, "--parallel"), flag(command, "--ctx-size")) == ("64", str(64 * 768))
    assert (flag(command, "--host"), flag(command, "--port"), flag(command, "--threads")) == ("127.0.0.1", "9000", "2")
    assert "--cont-batching" in command


def test_kvloom_serve_runs_the_shipped_config_with_the_shared_settings():
    doc = peers.kvloom_serve_config(SETTINGS, 8555, "auto")
    config = ClusterConfig.model_validate(doc)  # what `kvloom serve --config` will accept
    assert config.http.port == 8555 and config.model_name == peers.SERVED_NAME
    assert (config.engine.dtype, config.engine.max_num_seqs, config.engine.kv_cache_memory_bytes) == ("auto", 64, 2 << 30)
    shipped = yaml.safe_load((Path(peers.__file__).parent.parent / "configs" / "local-cpu.yaml").read_text())
    assert config.resources.model_dump(exclude_unset=True) == shipped["resources"]
    assert peers.kvloom_serve_command(Path("c.yaml"))[1:] == ["-m", "kvloom.cluster.cli", "serve", "--config", "c.yaml"]


def test_the_offline_driver_output_becomes_one_record_per_request():
    doc = {"wall_s": 2.5, "load_s": 9.0, "outputs": {"w1-1": [1, 2], "w1-0": [3, 4, 5, 6]}}
    records, wall = peers.parse_vllm_offline(json.loads(json.dumps(doc)), WORKLOAD)
    assert wall == 2.5 and [r.request_id for r in records] == ["w1-0", "w1-1"]
    assert records[0].output_token_ids == [3, 4, 5, 6] and records[0].num_prompt_tokens == 3
    assert records[1].finished == 2.5


def test_vllm_takes_the_same_speculative_config_as_json():
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    command = peers.vllm_offline_command(Path("p"), Path("w"), Path("m"), Path("o"), SETTINGS, "float32", 8, config)
    assert json.loads(flag(command, "--speculative-config")) == config
    assert "--speculative-config" not in peers.vllm_offline_command(Path("p"), Path("w"), Path("m"), Path("o"),
                                                                    SETTINGS, "float32", 8)


def test_vllm_takes_the_lora_benchmarks_adapters_and_limits_as_json():
    lora = {"adapters": {"r8-0": "/a/r8-0"}, "max_loras": 8, "max_cpu_loras": 8, "max_lora_rank": 64}
    command = peers.vllm_offline_command(Path("p"), Path("w"), Path("m"), Path("o"), SETTINGS, "float32", 8,
                                         lora=lora)
    assert json.loads(flag(command, "--lora")) == lora
    assert "--lora" not in peers.vllm_offline_command(Path("p"), Path("w"), Path("m"), Path("o"), SETTINGS,
                                                      "float32", 8)
    served = peers.vllm_server_command(Path("p"), Path("/m"), 8123, SETTINGS, "float32", 8, lora)
    assert "--enable-lora" in served and flag(served, "--lora-modules") == "r8-0=/a/r8-0"
    assert (flag(served, "--max-loras"), flag(served, "--max-cpu-loras"), flag(served, "--max-lora-rank")) == \
        ("8", "8", "64")


def test_vllms_own_token_times_give_each_request_its_ttft_and_tpot():
    doc = {"wall_s": 2.5, "outputs": {"w1-0": [3, 4, 5, 6], "w1-1": [1, 2]},
           "times": {"w1-0": [0.5, 0.8], "w1-1": [1.0, 2.5]}}
    first, second = peers.parse_vllm_offline(doc, WORKLOAD)[0]
    assert (first.ttft, first.finished) == (0.5, 0.8) and first.tpot == pytest.approx(0.1)
    assert (second.ttft, second.tpot) == (1.0, 1.5)


def test_a_request_missing_from_the_driver_output_is_an_error():
    with pytest.raises(ValueError, match="w1-1"):
        peers.parse_vllm_offline({"wall_s": 1.0, "outputs": {"w1-0": [1]}}, WORKLOAD)


def test_a_peer_not_set_up_is_reported_with_its_setup_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOOM_PEERS_DIR", str(tmp_path))
    path = WORKLOAD.save(tmp_path / "w1.jsonl")
    for spec in (SystemSpec("vllm-bf16", "vllm", engine={"dtype": "bfloat16"}),
                 SystemSpec("vllm-serve-bf16", "vllm-serve"), SystemSpec("llama.cpp-f16", "llama.cpp")):
        result = peers.run_external(spec, path, SETTINGS, tmp_path / spec.name, 60)
        assert result.metrics is None and result.status.startswith("not set up: run `bash benchmarks/peer_setup/")


def test_peer_selection_follows_the_cpu():
    amx = HostISA("x", frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
    zen3 = HostISA("y", frozenset({"avx2"}))
    assert [s.name for s in peers.external_systems(["vllm", "llama.cpp"], amx)] == [
        "vllm-bf16", "vllm-fp32", "continuous-fp32", "llama.cpp-bf16", "llama.cpp-q8_0", "llama.cpp-q4_0"]
    # llama.cpp's 16-bit type follows the CPU; its quantized ones run everywhere, the fastest is compared
    assert [s.name for s in peers.external_systems(["llama.cpp"], zen3)] == [
        "llama.cpp-f16", "llama.cpp-q8_0", "llama.cpp-q4_0"]
    assert [Path(flag(peers.server_command(s, SETTINGS, 768, 9000, Path("/tmp"))[0], "-m")).name
            for s in peers.external_systems(["llama.cpp"], zen3)] == [
        "smollm2-f16.gguf", "smollm2-q8_0.gguf", "smollm2-q4_0.gguf"]
    # vLLM emulates bfloat16 without it in hardware: float32 is its best there, offline and served
    assert [s.name for s in peers.external_systems(["vllm", "vllm-serve"], zen3)] == [
        "vllm-fp32", "continuous-fp32", "vllm-serve-fp32"]
    assert [s.name for s in peers.external_systems(["vllm-serve"], amx)] == ["vllm-serve-bf16"]
    kinds = [s.kind for s in make_systems(["continuous"], ["vllm-serve", "kvloom-serve"])]
    assert kinds == ["kvloom", "vllm-serve", "kvloom-serve"]
    with pytest.raises(ValueError, match="unknown"):
        make_systems(["continuous"], ["tgi"])


def test_latency_goal_compares_with_the_vllm_serve_that_ran():
    from kvloom.benchmarks.goals import latency_peer_goal

    def served(name: str, kind: str, ttft: float, tpot: float) -> dict:
        stats = {"ttft": {"p50": ttft, "p99": 2 * ttft}, "tpot": {"p50": tpot, "p99": 2 * tpot}}
        return {"spec": {"name": name, "kind": kind}, "metrics": stats}

    run = {"params": {}, "results": [served("vllm-serve-fp32", "vllm-serve", 0.2, 0.05),
                                     served("kvloom-serve", "kvloom-serve", 0.1, 0.04)]}
    goal = latency_peer_goal([run], "single-stream")
    assert goal.met and "ttft.p50 100 vs 200 ms" in goal.measured
    run["results"][1] = served("kvloom-serve", "kvloom-serve", 0.3, 0.04)
    assert latency_peer_goal([run], "single-stream").met is False


def test_llama_cpp_goal_compares_with_its_fastest_gguf_type_that_ran():
    from kvloom.benchmarks.goals import peer_goals

    def ran(name: str, kind: str, tok_s: float | None) -> dict:
        return {"spec": {"name": name, "kind": kind, "engine": {}},
                "metrics": None if tok_s is None else {"output_tok_s": tok_s, "peak_rss_mb": 1000.0}}

    run = {"results": [ran("continuous", "kvloom", 120.0), ran("kvloom-serve", "kvloom-serve", 96.0),
                       ran("llama.cpp-f16", "llama.cpp", 68.0), ran("llama.cpp-q8_0", "llama.cpp", 64.0),
                       ran("llama.cpp-q4_0", "llama.cpp", 74.0), ran("llama.cpp-bf16", "llama.cpp", None)]}
    goal = next(g for g in peer_goals(run) if g.name == "W1 over HTTP vs llama.cpp")
    assert goal.met is False
    assert goal.measured.startswith("1.30x") and "llama.cpp-q4_0 74.0" in goal.measured


def test_kvloom_serves_engine_counters_are_summed_over_replicas_from_the_routers_metrics():
    table = ReplicaTable(slack=0)
    for replica_id, steps, requests, seconds in (("a", 10, 300, 2.5), ("b", 4, 40, 0.5)):
        table.report(ReplicaStats(replica_id, max_num_seqs=64, engine_steps=steps, engine_step_requests=requests,
                                  engine_step_seconds=seconds))
    before = peers.EngineCounters(steps=4, requests=40, seconds=1.0)
    run = peers.EngineCounters.parse(RouterMetrics(table).render().decode()) - before
    assert run == peers.EngineCounters(steps=10, requests=300, seconds=2.0)


def test_the_quantized_comparison_serves_one_gguf_file_to_both_servers(tmp_path):
    """llama.cpp's Q4_1 peer loads the embedded file itself; `kvloom serve` gets the spec's engine settings
    (`quantization: gguf` here) in its YAML, its dtype staying the shared default."""
    import yaml

    from kvloom.engine.model.model_files import embedded_gguf

    llama = peers.server_command(SystemSpec("llama.cpp-q4_1", "llama.cpp", engine={"dtype": "q4_1"}), SETTINGS, 768,
                                 9000, tmp_path)[0]
    assert Path(flag(llama, "-m")) == embedded_gguf("smollm2")
    served = peers.server_command(SystemSpec("kvloom-serve-q4_1", "kvloom-serve", engine={"quantization": "gguf"}),
                                  SETTINGS, 768, 9000, tmp_path)[0]
    engine = yaml.safe_load(Path(flag(served, "--config")).read_text())["engine"]
    assert engine["quantization"] == "gguf" and engine["dtype"] == "auto" and engine["model"] == "smollm2"
