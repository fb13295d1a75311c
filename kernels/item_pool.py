"""Which threads run a CPU step's parallel work: torch's OpenMP team, or kvloom's own item pool.

Every parallel region of torch's OpenMP team ends at a barrier that each of its threads must reach. On a
serving host the engine's threads share the cores with the HTTP router, Ray and the client, so one of
them is often descheduled, and then the other waits at the next barrier for as long as the OS keeps it
off, even when nothing is left for it to do (docs/performance.md). kvloom's kernels deal their work as items
(kernels/cpu_deal.h); on the item pool a call is over once its items are, and the threads still running
take the descheduled one's share. The pool runs only kvloom's kernels, so it is used where they are all
a step's heavy work: every linear is the blocked GEMM (AVX-512 CPUs without AMX). Elsewhere
oneDNN's GEMMs need torch's team, and two teams spinning on the same cores would take turns at them, so
the pool stays off. While it is on, torch keeps one thread (the small ops left to it run inline).
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvloom.kernels.cpu_extensions import build_extension

logger = logging.getLogger(__name__)


def _pool():
    return build_extension("kvloom_cpu_pool")


def pool_threads() -> int:
    """The item pool's threads, 0 while it is off."""
    ops = _pool()
    return ops.pool_threads() if ops is not None else 0


def intra_op_threads() -> int:
    """Threads a step's parallel work runs on, whichever runs it."""
    return pool_threads() or torch.get_num_threads()


def set_intra_op_threads(threads: int) -> None:
    """On the thread that runs the steps (torch's count is per calling thread)."""
    if pool_threads():
        _pool().set_pool_threads(threads)
    else:
        torch.set_num_threads(threads)


def use_item_pool(enabled: bool) -> None:
    """Move the step's threads to the item pool (or back to torch's team), keeping their number. Turned on, or
    found on, the calling thread's torch ops run inline (one thread) beside the pool, whatever another thread or
    an offline `LLM` (engine/llm.py) set there before."""
    ops = _pool()
    if ops is None:
        return
    if enabled == bool(ops.pool_threads()):
        if enabled:
            torch.set_num_threads(1)
        return
    threads = intra_op_threads()
    if enabled:
        torch.set_num_threads(1)
        ops.set_pool_threads(threads)
    else:
        ops.set_pool_threads(0)
        torch.set_num_threads(threads)
    logger.info("%d thread(s) on %s", threads, "kvloom's item pool" if enabled else "torch's OpenMP team")


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """This thread's torch ops on `threads` threads for the body, its own count again after: an offline engine
    steps on its caller's thread (engine/llm.py), whose torch work afterwards keeps every core it had."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
