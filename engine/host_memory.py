"""Linux memory advice for large CPU tensors (no-ops elsewhere).

madvise works on whole pages, so each call covers only the pages entirely inside the tensor: the
neighbours sharing its first and last page are never touched.
"""

import ctypes
import sys
from pathlib import Path

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


def _mapping_of(first: int, last: int) -> tuple[str, int] | None:
    """(path, anonymous kB) of the one memory mapping holding bytes first..last, from /proc/self/smaps."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside, path = False, ""
    for line in lines:
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: start-end perms offset dev inode [path]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside, path = start <= first and last < end, fields[5] if len(fields) > 5 else ""
        elif inside and fields[0] == "Anonymous:":
            return path, int(fields[1])
    return None


def release_file_pages(tensor: torch.Tensor) -> bool:
    """Drop the resident pages of a tensor that is still read, if they are clean pages of a file.

    Weights loaded from safetensors are a private mapping of the file; while none of its pages has
    been written (copied on write), a dropped page is simply read back from the page cache when
    touched, so only the parts still in use stay resident (an embedding table: the rows of the
    tokens seen). Anonymous memory, or a mapping with written pages, is left alone: dropping those
    pages would lose data. Returns whether the pages were released.
    """
    if tensor.device.type != "cpu" or sys.platform != "linux":
        return False
    mapping = _mapping_of(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1)
    if mapping is None or not mapping[0].startswith("/") or mapping[1] != 0:
        return False
    _advise(tensor, MADV_DONTNEED, PAGE)
    return True
