"""The GPU benchmark's code path, run on CPU at tiny sizes (`--quick`): ceilings, decode steps against their
roofline floors, W1 through the engine and the greedy parity check all run and land in the report. Its figures
say nothing about a GPU; the device check (benchmarks/gpu_check.sh) runs it for real."""

import json
import math

import pytest
import torch

from kvloom.benchmarks import gpu
from kvloom.benchmarks.random_weights import RandomCheckpoint, tensor_shapes
from kvloom.engine.model.model_config import ModelConfig


def test_a_quick_run_on_cpu_writes_every_section_and_frees_each_engine_before_the_next(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """On a device the next engine's KV budget is what the last one left: a runner still alive (a closure, a cycle
    only the collector breaks) would leave it no room. Every runner is tracked by a weak reference."""
    import weakref

    from kvloom.engine.runner import ModelRunner

    made, alive_at_start = [], []
    original = ModelRunner.__init__

    def tracked(self, *args, **kwargs):
        alive_at_start.append(sum(ref() is not None for ref in made))
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(ModelRunner, "__init__", tracked)
    report = gpu.main(["--device", "cpu", "--quick", "--model-dir", str(tiny_model_dir), "--out", str(tmp_path)])
    assert report["ceilings"]["copy_gb_s"] > 0 and report["ceilings"]["matmul_tflop_s"] > 0
    assert {s["model"] for s in report["decode"]} == {"SmolLM2 shape", "8B Llama shape"}
    assert all(s["step_ms"] > 0 and s["floor_ms"] > 0 for s in report["decode"])
    assert report["w1"]["float32"]["num_requests"] == 8
    assert report["w1"]["greedy_parity"]["equal"] == report["w1"]["greedy_parity"]["prompts"]  # cpu vs cpu
    written = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert written["decode"] == report["decode"]
    assert "roofline floor" in next(tmp_path.glob("*.md")).read_text()
    assert {p.name for p in tmp_path.glob("profile-*.txt")} == {"profile-smollm2.txt", "profile-8b.txt"}
    assert "## eager, ten steps" in (tmp_path / "profile-8b.txt").read_text()
    assert len(made) >= 4 and alive_at_start == [0] * len(made)
    assert all(ref() is None for ref in made)


def test_the_roofline_floor_of_a_batch_1_decode_is_reading_the_weights(tmp_path):
    config = ModelConfig.from_dir(gpu.write_config(tmp_path, gpu.LLAMA_8B))
    ceilings = gpu.Ceilings(copy_gb_s=4000, read_gb_s=4200, matmul_tflop_s=800)  # reads at the better of the two
    floor_s, bound = gpu.decode_floor_s(config, 1, 0, torch.bfloat16, ceilings)
    params = sum(math.prod(shape) for name, shape in tensor_shapes(config).items()
                 if "norm" not in name and "embed" not in name)
    assert bound == "memory" and floor_s == pytest.approx(params * 2 / 4.2e12, rel=1e-6)
    assert 7e9 < params < 8.1e9  # an 8B model's linear weights (embedding rows are not read whole)


def test_a_random_checkpoint_has_every_tensor_the_fused_decoder_reads(tiny_model_dir):
    from kvloom.engine.model.decoder import FusedDecoder

    config = ModelConfig.from_dir(tiny_model_dir)
    checkpoint = RandomCheckpoint(config, torch.float32, torch.device("cpu"))
    assert FusedDecoder.unsupported(config, checkpoint) is None
    FusedDecoder(config, checkpoint)


def test_the_device_check_bounds_each_phase_and_all_of_them_fit_six_minutes():
    """15 minutes of device time must hold the check, a fix and a rerun (plus each machine's start)."""
    import re
    from pathlib import Path

    script = (Path(gpu.__file__).parent / "gpu_check.sh").read_text()
    limits = {name: int(seconds) for name, seconds in re.findall(r"^phase (\w+) (\d+) ", script, re.MULTILINE)}
    limits |= {name: int(seconds) for seconds, name in re.findall(r"^TESTS_LIMIT=(\d+) tests ([\w-]+) ", script,
                                                                   re.MULTILINE)}
    # the kernels built before the tests
    assert list(limits) == ["install", "build", "benchmark", "engine-tests", "kernel-tests"]
    assert sum(limits.values()) < 6 * 60
    calls = re.findall(r"^(?!phase ).*python3 -m (?:pytest|kvloom)", script, re.MULTILINE)
    assert calls == ['  phase "$name" "$TESTS_LIMIT" python3 -m pytest']  # every run within a phase's bound
