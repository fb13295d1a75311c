"""kvloom's item pool (kernels/cpu_deal.h, kernels/item_pool.py): which engines run their kernels on it, and
that a kernel gives the same bits on it as on torch's OpenMP team, from any thread, in a forked child too."""

import multiprocessing
import os
import threading

import pytest
import torch

from kvloom.engine.llm import LLM
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels import item_pool, packed_linear
from kvloom.kernels.host_isa import HostISA
from kvloom.kernels.packed_linear import Layout, PackedLinear, to_blocked

POOL = 1 << 24  # KV bytes: room for these prompts (the default 2 GiB costs an engine 1-7 s to fault in here)

BLOCKED_KERNEL = pytest.mark.host("blocked-gemm")


def blocked_linear_case(seed: int = 0, rows: int = 70) -> tuple[PackedLinear, torch.Tensor]:
    torch.manual_seed(seed)
    weight, x = torch.randn(1536, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    return PackedLinear(to_blocked(weight), None, Layout.BLOCKED, 1536), x


def test_the_pool_takes_torchs_threads_and_gives_them_back(kernel_threads):
    kernel_threads(3, pool=False)
    item_pool.use_item_pool(True)
    assert (item_pool.pool_threads(), torch.get_num_threads(), item_pool.intra_op_threads()) == (3, 1, 3)
    item_pool.set_intra_op_threads(2)  # e.g. a second replica started on the node
    assert (item_pool.pool_threads(), torch.get_num_threads()) == (2, 1)
    torch.set_num_threads(2)  # e.g. an offline LLM gave its caller's threads back
    item_pool.use_item_pool(True)  # found on: this thread's torch ops inline beside it again
    assert (item_pool.pool_threads(), torch.get_num_threads()) == (2, 1)
    item_pool.use_item_pool(False)
    assert (item_pool.pool_threads(), torch.get_num_threads(), item_pool.intra_op_threads()) == (0, 2, 2)


@BLOCKED_KERNEL
def test_an_engine_on_the_blocked_kernel_runs_on_the_pool_and_one_on_onednn_on_openmp(
        tiny_model_dir, kernel_threads, monkeypatch):
    kernel_threads(2, pool=False)
    LLMEngine(dtype="bfloat16", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    assert (item_pool.pool_threads(), torch.get_num_threads()) == (2, 1)
    monkeypatch.setattr(packed_linear, "host_isa", lambda: HostISA("AVX2 only", frozenset({"avx2"})))
    # oneDNN's GEMMs need torch's team
    LLMEngine(dtype="float32", model=str(tiny_model_dir), block_size=4, kv_cache_memory_bytes=POOL)
    assert (item_pool.pool_threads(), torch.get_num_threads()) == (0, 2)


@BLOCKED_KERNEL
def test_an_offline_llm_moves_its_callers_torch_threads_only_while_it_steps(tiny_model_dir, kernel_threads):
    """Its steps run on the caller's thread, torch's ops there inline (one thread) beside the pool; before and
    after, the caller's own torch work keeps the threads it had."""
    kernel_threads(2, pool=False)
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", block_size=4, kv_cache_memory_bytes=POOL)
    assert (item_pool.pool_threads(), torch.get_num_threads()) == (2, 2)
    during, step = [], llm.engine.step
    llm.engine.step = lambda: during.append(torch.get_num_threads()) or step()
    [output] = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 3
    assert set(during) == {1} and torch.get_num_threads() == 2


@BLOCKED_KERNEL
def test_kernels_called_from_two_threads_at_once_both_get_their_answer(kernel_threads):
    """One call holds the pool; the other, meanwhile, runs on its own thread."""
    cases = [blocked_linear_case(seed) for seed in (1, 2)]
    expected = [linear(x) for linear, x in cases]
    kernel_threads(2, pool=True)
    results: dict[tuple[int, int], torch.Tensor] = {}

    def call(i: int) -> None:
        for repeat in range(20):
            results[i, repeat] = cases[i][0](cases[i][1])

    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(result, expected[i]) for (i, _), result in results.items())


def _child_result(queue) -> None:
    """In a forked child: a call (it must start a worker: the parent's do not exist here), then another thread
    count (stopping the child's workers must not wait for the parent's) and a call on it."""
    linear, x = blocked_linear_case()
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    before = threads()
    first = linear(x)
    started = threads() - before
    item_pool.set_intra_op_threads(3)
    queue.put((started, first.float().tolist(), linear(x).float().tolist()))  # plain data: the child exits first


@BLOCKED_KERNEL
def test_a_forked_child_starts_workers_of_its_own(kernel_threads):
    """The parent's workers do not exist in a fork: the child's first call starts its own."""
    linear, x = blocked_linear_case()
    kernel_threads(2, pool=True)
    expected = linear(x)  # the parent's workers are running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_result, args=(queue,), daemon=True)  # a hung child fails this test only
    child.start()
    try:
        started, first, second = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        child.kill()
    assert child.exitcode == 0 and started == 1
    assert first == second == expected.float().tolist()


@BLOCKED_KERNEL
def test_a_changed_thread_count_restarts_the_workers(kernel_threads):
    linear, x = blocked_linear_case()
    expected = linear(x)
    for threads in (2, 3, 1, 2):
        kernel_threads(threads, pool=True)
        assert torch.equal(linear(x), expected)
