"""The CUDA LoRA path (Triton segmented matmul over slot buffers) against the CPU path's plain GEMMs.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors; as in test_triton_kernels.py, the flag must be
set before the process first imports triton, so where something imported it earlier the file re-runs itself in a
fresh process.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kvloom.benchmarks.random_weights import write_random_adapter  # noqa: E402
from kvloom.engine.lora.adapter import load_adapter  # noqa: E402
from kvloom.engine.lora.adapter_slots import AdapterSlots  # noqa: E402
from kvloom.engine.lora.lora_step import LoRAStep  # noqa: E402
from kvloom.engine.model.model_config import ModelConfig  # noqa: E402
from kvloom.kernels import triton_lora  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.triton_kernels  # conftest.py: CUDA, Triton's interpreter, or a fresh process


def test_whole_file_in_a_fresh_interpreter_process(rerun_in_fresh_interpreter):
    rerun_in_fresh_interpreter(__file__)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_segmented_matmul_touches_only_its_segments_rows_with_each_segments_slot(dtype, tolerance, accumulate):
    generator = torch.Generator().manual_seed(0)
    rows, k, n, slots = 70, 40, 72, 3  # none a multiple of the kernel's tiles
    x = torch.randn(rows, k, generator=generator).to(dtype)
    w = torch.randn(slots, k, n, generator=generator).to(dtype)
    segments = [(3, 20, 2), (20, 21, 0), (30, 70, 2), (60, 60, 1)]  # rows 0-2 and 21-29: base rows
    window = slice(10, 66)  # the caller passes these rows only (an MLP chunk)
    out = torch.full((rows, n), 7.0).to(dtype)
    expected = out.clone().float()
    for start, end, slot in segments:
        lo, hi = max(start, window.start), min(end, window.stop)
        if lo < hi:
            product = x[lo:hi].float() @ w[slot].float()
            expected[lo:hi] = expected[lo:hi] + product if accumulate else product
    starts, ends, slot_ids = (torch.tensor(column, dtype=torch.int32, device=DEVICE) for column in zip(*segments))
    x, w, out = x.to(DEVICE), w.to(DEVICE), out.to(DEVICE)
    triton_lora.segmented_matmul(x[window], w, out[window], starts, ends, slot_ids, longest=40,
                                 row_offset=window.start, accumulate=accumulate)
    torch.testing.assert_close(out.cpu().float(), expected, atol=tolerance * k ** 0.5, rtol=tolerance)


def test_slotted_step_adds_what_the_cpu_path_adds_through_slot_eviction_and_row_windows(tiny_model_dir, tmp_path):
    config = ModelConfig.from_dir(tiny_model_dir)
    adapters = [load_adapter(f"a{i}", write_random_adapter(tmp_path / f"a{i}", config, rank, seed=i, targets=targets),
                             config, 16, torch.float32)
                for i, (rank, targets) in enumerate([(4, ("q_proj", "v_proj")), (16, ("gate_proj", "down_proj")),
                                                     (8, ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"))])]
    slots = AdapterSlots(config, max_loras=2, max_rank=16, dtype=torch.float32, device=torch.device(DEVICE))
    steps = [[(3, adapters[0]), (2, None), (5, adapters[1])],  # two adapters fill both slots
             [(4, adapters[2]), (1, adapters[1]), (2, None)]]  # a third evicts the least recently used
    generator = torch.Generator().manual_seed(1)
    for rows in steps:
        total, samples = sum(n for n, _ in rows), [2, 4, 9]
        plain, slotted = LoRAStep.of_rows(rows, samples), slots.step(rows, samples)
        for linear, (width_in, width_out) in {"qkv": (64, 128), "o_proj": (64, 64), "gate_up": (64, 256),
                                              "down": (128, 64)}.items():
            x = torch.randn(total, width_in, generator=generator)
            y = torch.randn(total, width_out, generator=generator)
            want, got = y.clone(), y.clone().to(DEVICE)
            plain.add(1, linear, x, want)
            slotted.add(1, linear, x.to(DEVICE), got)
            torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
            window = slice(4, total)
            want_window, got_window = y[window].clone(), y[window].clone().to(DEVICE)
            plain.add(1, linear, x[window], want_window, first_row=4)
            slotted.add(1, linear, x[window].to(DEVICE), got_window, first_row=4)
            torch.testing.assert_close(got_window.cpu(), want_window, atol=1e-5, rtol=1e-5)
        kept_x, kept_y = torch.randn(len(samples), 64, generator=generator), torch.zeros(len(samples), 64)
        want, got = kept_y.clone(), kept_y.clone().to(DEVICE)
        plain.kept_rows().add(0, "o_proj", kept_x, want)
        slotted.kept_rows().add(0, "o_proj", kept_x.to(DEVICE), got)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert len(slots.slot_of) == 2 and adapters[0].cache_root not in slots.slot_of
