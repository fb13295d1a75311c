"""Linux memory advice for large CPU tensors (no-ops elsewhere).

madvise works on whole pages, so each call covers only the pages entirely inside the tensor: the
neighbours sharing its first and last page are never touched.
"""

import ctypes
import sys

import torch

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
PAGE = 4096
HUGE_PAGE = 2 << 20


def _advise(tensor: torch.Tensor, advice: int, granule: int) -> None:
    if tensor.device.type != "cpu" or sys.platform != "linux":
        return
    start = -(-tensor.data_ptr() // granule) * granule
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // granule * granule
    if end > start:  # advice only: a refusal leaves the memory as it was
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for transparent huge pages before first touch: fewer TLB misses on scattered reads."""
    _advise(tensor, MADV_HUGEPAGE, HUGE_PAGE)


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a tensor about to be discarded.

    For weights mapped from a safetensors file the mapping outlives the tensor (the file's other
    tensors keep it), so its pages would stay resident; dropped, they would simply be re-read from
    the file if anything touched them again. Only for tensors nothing will read afterwards.
    """
    _advise(tensor, MADV_DONTNEED, PAGE)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc only; a no-op elsewhere).

    Loading frees tens of MB of temporaries (the tokenizer's parsed JSON, weights concatenated for
    packing) in the middle of the heap, where they would otherwise stay resident for the process's life.
    """
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # a C library without malloc_trim (musl)
        pass
