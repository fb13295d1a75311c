"""Releasing a tensor's pages while it is still read loses nothing (engine/host_memory.py).

The fused decoder drops the resident pages of the dense embedding table once the LM head has a
packed copy; the table is still read a row per token, so this may only happen where dropped
pages come back intact: clean pages of a file mapping (weights as mapped from safetensors).
"""

import sys

import numpy as np
import pytest
import torch

from kvloom.engine.host_memory import release_file_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/smaps are Linux's")
ROWS, COLS = 512, 1024  # 2 MB: many whole pages


def resident_pages(tensor: torch.Tensor) -> int:
    """Pages of the tensor's mapping that are in memory (mincore would be exact; smaps' Rss is per mapping)."""
    address = tensor.data_ptr()
    for header, *body in _smaps_entries():
        start, end = (int(x, 16) for x in header.split()[0].split("-"))
        if start <= address < end:
            return next(int(line.split()[1]) for line in body if line.startswith("Rss:")) // 4
    raise AssertionError("no mapping holds the tensor")


def _smaps_entries():
    entry = []
    for line in open("/proc/self/smaps").read().splitlines():
        if not line.split()[0].endswith(":") and entry:
            yield entry
            entry = []
        entry.append(line)
    yield entry


@pytest.fixture
def weights_file(tmp_path):
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    return path, torch.from_numpy(data.copy())


def test_clean_file_pages_are_dropped_and_read_back_intact(weights_file):
    path, expected = weights_file
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=(ROWS, COLS)))  # private, like safetensors
    assert torch.equal(mapped, expected)  # every page resident now
    before = resident_pages(mapped)
    assert release_file_pages(mapped)
    assert resident_pages(mapped) < before // 2
    assert torch.equal(mapped[17], expected[17]) and torch.equal(mapped, expected)


def test_anonymous_memory_is_left_alone(weights_file):
    _, expected = weights_file
    anonymous = expected.clone()
    assert not release_file_pages(anonymous)
    assert torch.equal(anonymous, expected)


def test_a_mapping_with_written_pages_is_left_alone(weights_file):
    path, expected = weights_file
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=(ROWS, COLS)))
    mapped[3, 5] = -1.0  # copied on write: dropping that page would bring back the file's value
    assert not release_file_pages(mapped)
    assert mapped[3, 5].item() == -1.0
    assert torch.equal(mapped[4:], expected[4:])
