"""Cluster YAML: every shipped config loads; a bad file fails with the file and the key named."""

from pathlib import Path

import pytest

from kvloom.cluster.app import expected_replicas
from kvloom.cluster.config import ClusterConfigError, load_cluster_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_cluster_config(path)
    assert expected_replicas(config) >= 1


def test_all_expected_configs_ship():
    names = {p.name for p in CONFIGS}
    assert {"local-cpu.yaml", "multi-replica-cpu.yaml", "gpu.yaml", "autoscaling.yaml", "disaggregated.yaml",
            "multi-tenant.yaml"} <= names


@pytest.mark.parametrize(
    "text, key",
    [
        ("engine:\n  blocksize: 16\n", "engine.blocksize"),
        ("engine:\n  block_size: 12\n", "engine.block_size"),
        ("num_replicas: 0\n", "num_replicas"),
        ("disaggregation:\n  transport: carrier-pigeon\n", "disaggregation.transport"),
        ("frobnicate: 1\n", "frobnicate"),
    ],
)
def test_bad_values_name_the_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ClusterConfigError) as err:
        load_cluster_config(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("engine: [unclosed\n")
    with pytest.raises(ClusterConfigError, match="broken.yaml"):
        load_cluster_config(path)


def test_kvloom_serve_on_a_bad_config_prints_one_line_naming_the_file_and_key_and_no_traceback(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  block_size: 12\n")
    done = subprocess.run([sys.executable, "-m", "kvloom.cluster.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and str(path) in done.stderr and "engine.block_size" in done.stderr, done.stderr


AUTOSCALING = "autoscaling:\n  min_replicas: {min}\n  max_replicas: {max}\n  target: {target}\n  downscale_delay_s: {down}\n"


@pytest.mark.parametrize(
    "values, key",
    [
        ({"min": 3, "max": 2}, "min_replicas (3) is over max_replicas (2)"),
        ({"target": "{queue_depth: 4}"}, "autoscaling.target.queue_depth"),
        ({"target": "{}"}, "autoscaling.target: set exactly one of waiting_per_replica, kv_usage"),
        ({"target": "{kv_usage: 0.8, waiting_per_replica: 4}"}, "autoscaling.target: set exactly one"),
        ({"target": "{kv_usage: 1.5}"}, "autoscaling.target.kv_usage"),
        ({"down": -1}, "autoscaling.downscale_delay_s"),
        ({"min": -1}, "autoscaling.min_replicas"),
        ({"target": "{ttft_p90_s: 0}"}, "autoscaling.target.ttft_p90_s"),
    ],
)
def test_bad_autoscaling_settings_name_the_file_and_field(tmp_path, values, key):
    path = tmp_path / "scaling.yaml"
    path.write_text(AUTOSCALING.format(**{"min": 1, "max": 3, "target": "{waiting_per_replica: 4}", "down": 30,
                                          **values}))
    with pytest.raises(ClusterConfigError) as err:
        load_cluster_config(path)
    assert str(path) in str(err.value) and key in str(err.value), str(err.value)


def test_a_negative_graceful_period_is_refused_and_zero_replicas_at_rest_is_allowed(tmp_path):
    path = tmp_path / "scaling.yaml"
    base = AUTOSCALING.format(min=0, max=2, target="{ttft_p90_s: 2.5}", down=30)
    path.write_text(base + "  graceful_period_s: -1\n")
    with pytest.raises(ClusterConfigError, match="autoscaling.graceful_period_s"):
        load_cluster_config(path)
    path.write_text(base)
    assert load_cluster_config(path).autoscaling.min_replicas == 0


def test_one_way_of_scaling_at_a_time(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("num_replicas: 2\n" + AUTOSCALING.format(min=1, max=3, target="{kv_usage: 0.8}", down=30))
    with pytest.raises(ClusterConfigError, match="autoscaling: set only one of num_replicas, autoscaling"):
        load_cluster_config(path)


def test_lora_at_the_top_level_configures_the_engines_and_is_checked_at_load(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text("lora:\n  adapters: {bot: /adapters/bot}\n  max_loras: 2\n")
    config = load_cluster_config(path)
    assert config.engine.lora.adapters == {"bot": "/adapters/bot"} and config.engine.lora.max_loras == 2
    for text, key in [("lora: {}\nengine:\n  lora: {}\n", "lora: set it once"),
                      ("lora:\n  adapters: {'smollm2:bot': /x}\n", "adapter name 'smollm2:bot'"),
                      ("lora:\n  max_loras: 8\n  max_cpu_loras: 2\n", "max_cpu_loras (2) must be at least"),
                      ("lora: {}\nengine:\n  tensor_parallel_size: 2\n", "lora with tensor_parallel_size")]:
        path.write_text(text)
        with pytest.raises(ClusterConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
            load_cluster_config(path)
