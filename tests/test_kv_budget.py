"""The CUDA KV budget without a device: its arithmetic (engine/kv_budget.py) on H200-like figures, the worst step it
profiles, and the gathering (resources.profile_cuda_budget) over a stand-in for torch.cuda's memory functions, with
fake runners and then with the engine's own runners on CPU."""

import logging
from dataclasses import dataclass, field, replace

import pytest
import torch

from kvloom.engine import llm_engine
from kvloom.engine.errors import ConfigError
from kvloom.engine.config import EngineConfig
from kvloom.engine.kv_budget import GiB, DeviceMemory, kv_budget_bytes, worst_step_lengths
from kvloom.engine.resources import WORST_SAMPLING, kv_block_count, profile_cuda_budget
from kvloom.kernels.backends import AttentionBackend

GB = 10**9
# an H200 (141 GB) shared with another process using 10 GB; this process's CUDA context 0.5 GB; an 8B model's
# bf16 weights; a worst-case step of 4 GB, a draft's first pass of 1 GB and a graph pool of 0.3 GB
H200 = DeviceMemory(total=141 * GB, free=141 * GB - 10 * GB - GB // 2 - 16 * GB, held=16 * GB, step_peak=4 * GB,
                    draft_peak=GB, graph_pool=3 * GB // 10)


def test_the_budget_is_the_utilization_of_the_device_less_everything_else_on_it():
    assert H200.others == 10 * GB + GB // 2
    # 0.9 x 141 = 126.9 GB, less 10.5 taken by others and the context, 16 of weights, 4 of the step, 0.3 of graphs
    assert kv_budget_bytes(H200, 0.9) == 126_900_000_000 - 10_500_000_000 - 16 * GB - 4 * GB - 300_000_000


@pytest.mark.parametrize("term, more", [
    ("free", -5 * GB),  # another process takes 5 GB more
    ("held", GB),  # a LoRA slot buffer, say (what is held was taken from the free memory)
    ("step_peak", GB),
    ("graph_pool", GB),
])
def test_each_term_reduces_the_budget_by_what_it_takes(term, more):
    memory = replace(H200, **{term: getattr(H200, term) + more})
    if term == "held":
        memory = replace(memory, free=H200.free - more)
    assert kv_budget_bytes(H200, 0.9) - kv_budget_bytes(memory, 0.9) == abs(more)


def test_a_draft_pass_counts_where_it_outgrows_the_step_it_runs_before():
    """The draft's first pass and the target's step run one after the other: the larger peak is reserved."""
    assert kv_budget_bytes(replace(H200, draft_peak=0), 0.9) == kv_budget_bytes(H200, 0.9)
    bigger = replace(H200, draft_peak=H200.step_peak + 2 * GB)
    assert kv_budget_bytes(H200, 0.9) - kv_budget_bytes(bigger, 0.9) == 2 * GB


def test_nothing_left_names_the_utilization_and_gives_the_breakdown():
    with pytest.raises(ConfigError) as caught:
        kv_budget_bytes(H200, 0.2)  # 28.2 GB of the device: the others and the weights alone take 26.5
    message = str(caught.value)
    assert caught.value.key == "gpu_memory_utilization"
    for figure in (141 * GB, 10.5 * GB, 16 * GB, 4 * GB, GB, 0.3 * GB):
        assert f"{figure / GiB:.2f}" in message
    for part in ("other processes, CUDA context and NCCL", "weights", "worst-case step", "draft", "CUDA graph pool",
                 "short"):
        assert part in message


@pytest.mark.parametrize("tokens, rows, longest, expected", [
    (2048, 64, 4095, [1985] + [1] * 63),  # one long prompt chunk beside 63 decodes: every row sampled
    (8192, 256, 2047, [2047, 2047, 2047, 1799] + [1] * 252),  # no chunk longer than the longest prompt
    (16, 64, 4095, [1] * 16),  # fewer tokens than rows
    (10, 4, 1, [1] * 4),  # max_model_len 2: the step cannot be fuller
])
def test_the_worst_step(tokens, rows, longest, expected):
    assert worst_step_lengths(tokens, rows, longest) == expected


@dataclass
class FakeCuda:
    """torch.cuda's memory functions over counters that fake runners move."""
    total: int
    free: int
    reserved: int
    allocated: int = 0
    peak: int = 0

    def mem_get_info(self, device):
        return self.free, self.total

    def memory_reserved(self, device):
        return self.reserved

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated

    def empty_cache(self):
        pass

    def spike(self, size: int) -> None:
        """Allocate `size` bytes and free them."""
        self.peak = max(self.peak, self.allocated + size)


@dataclass
class FakeRunner:
    cuda: FakeCuda
    blocks: int
    step_bytes: int = 0
    pool_bytes: int = 0
    backend: AttentionBackend = AttentionBackend("triton", None, None, graph_safe=True)
    steps: list = field(default_factory=list)
    captured: tuple | None = None

    def __post_init__(self) -> None:
        self.cuda.allocated += self.blocks * 4096  # the probe's own KV: not the step's

    def execute(self, step):
        self.steps.append(step)
        self.cuda.spike(self.step_bytes)
        return {}

    def capture_graphs(self, max_num_seqs, max_blocks):
        self.captured = (max_num_seqs, max_blocks)
        self.cuda.free -= self.pool_bytes

    def prepare(self, step):
        self.steps.append(step)
        return step, [request for request, _ in step], None

    def forward(self, inputs):
        self.cuda.spike(self.step_bytes)


def test_the_gathering_measures_each_term_around_its_probe(caplog):
    cuda = FakeCuda(total=141 * GB, free=100 * GB, reserved=30 * GB, allocated=29 * GB)
    runners = []

    def runner(step_bytes, pool_bytes=0):
        def make(blocks):
            runners.append(FakeRunner(cuda, blocks, step_bytes, pool_bytes))
            return runners[-1]
        return make

    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)
    caplog.set_level(logging.INFO, logger="kvloom.engine.resources")
    budget = profile_cuda_budget(config, torch.device("cuda"), 4096, runner(3 * GB, GB // 2), runner(5 * GB),
                                 cuda=cuda)
    memory = DeviceMemory(141 * GB, 100 * GB, 30 * GB, step_peak=3 * GB, draft_peak=5 * GB, graph_pool=GB // 2)
    assert budget == kv_budget_bytes(memory, 0.9)
    assert f"KV budget {budget / GiB:.2f} GiB: {memory.describe(0.9)}" in caplog.text
    target, draft = runners
    assert target.captured == (64, 4096 // 16) and draft.captured is None
    (step,) = target.steps
    assert [n for _, n in step] == worst_step_lengths(2048, 64, 4095)
    assert all(r.sampling_params == WORST_SAMPLING for r, _ in step)
    blocks = [b for r, _ in step for b in r.block_ids]
    assert sorted(blocks) == list(range(target.blocks)) == list(range(draft.blocks))  # each request its own
    assert all(r.sampling_params.prompt_logprobs is None for r, _ in draft.steps[0])  # a pass: last rows only


def test_eager_engines_capture_no_graphs_to_measure():
    cuda = FakeCuda(total=80 * GB, free=60 * GB, reserved=10 * GB)
    made = []

    def make(blocks):
        made.append(FakeRunner(cuda, blocks, GB, pool_bytes=GB))
        return made[-1]

    config = EngineConfig(enforce_eager=True, gpu_memory_utilization=0.5)
    budget = profile_cuda_budget(config, torch.device("cuda"), 2048, make, cuda=cuda)
    assert made[0].captured is None
    assert budget == 40 * GB - 20 * GB - GB


def test_the_engine_profiles_its_target_and_draft_through_real_runners(tiny_model_dir, monkeypatch):
    """On CPU with torch.cuda's memory functions faked: the engine hands the profile its runner and its draft's,
    and the probes run through real ModelRunners: the worst step samples every request with 20 logprobs and records
    every prompt row's, and the draft's pass computes the logits of each request's last row."""
    cuda = FakeCuda(total=16 * GB, free=12 * GB, reserved=GB)
    seen, budgets = {}, []

    def recording(make, name):
        def made(blocks):
            runner = make(blocks)
            execute, forward = runner.execute, runner.forward
            runner.execute = lambda step: seen.setdefault(name, (step, execute(step)))[1]
            runner.forward = lambda inputs: seen.setdefault(f"{name} forward", forward(inputs))
            return runner
        return made

    def profile(config, device, max_model_len, make_runner, make_draft_runner):
        return profile_cuda_budget(config, device, max_model_len, recording(make_runner, "target"),
                                   recording(make_draft_runner, "draft"), cuda=cuda)

    def count(config, device, bytes_per_token, max_model_len, profile):
        budgets.append(profile())
        return kv_block_count(config, device, bytes_per_token, max_model_len, profile)

    monkeypatch.setattr(llm_engine, "profile_cuda_budget", profile)
    monkeypatch.setattr(llm_engine, "kv_block_count", count)
    llm_engine.LLMEngine(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 22,
                         max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128,
                         speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                             "model": str(tiny_model_dir)})
    assert budgets == [int(16 * GB * 0.9) - 4 * GB]  # nothing spiked the fake counters
    step, sampled = seen["target"]
    assert [n for _, n in step] == [127, 123] + [1] * 6
    assert len(sampled) == 8 and all(len(token.logprobs) >= 20 for (token,) in sampled.values())
    long_request = step[0][0]
    assert len(long_request.prompt_logprobs) == 127 and None not in long_request.prompt_logprobs[1:]
    assert seen["draft forward"].shape == (8, 512)  # the tiny model's vocabulary
