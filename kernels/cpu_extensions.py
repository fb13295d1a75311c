"""Builds kvloom's C++ CPU kernels once per machine with torch's JIT extension loader.

Sources sit next to this file and register their ops as `torch.ops.kvloom.*` (TORCH_LIBRARY, ATen's
own headers: a fresh build takes seconds, where pybind's torch/extension.h alone costs half a
minute). torch caches the build (keyed by the source's hash) under ~/.cache/torch_extensions, in a
folder per Python, torch version, CPU instruction set and shared-header hash, so only the first
process on a machine pays the compile; `python -m kvloom.kernels.cpu_extensions` does it ahead of time.
"""

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from kvloom.kernels.host_isa import host_isa

logger = logging.getLogger(__name__)
# -fopenmp: ATen's parallel_for is an inline `omp parallel`; compiled without it, every kernel runs on one thread
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++20", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
SOURCES = {"kvloom_cpu_decode": "cpu_decode.cpp", "kvloom_cpu_fused": "cpu_fused.cpp"}
HERE = Path(__file__).parent
STALE_LOCK_S = 600  # a build takes well under a minute; an older lock is a dead builder's


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's loader waits forever on the lock file of a build whose process was killed (a replica
    torn down mid-compile): drop a lock that no live build could still hold."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def _headers_key() -> str:
    """torch's loader rebuilds when a source changes, not a header it includes: the headers' hash goes
    into the build folder's name instead."""
    digest = hashlib.sha1(b"".join(path.read_bytes() for path in sorted(HERE.glob("*.h"))))
    return digest.hexdigest()[:8]


@functools.cache
def build_extension(name: str):
    """`torch.ops.kvloom` once `name` is loaded, or None (with a warning) where it cannot be built:
    callers stay correct, just slower."""
    from torch.utils.cpp_extension import get_default_build_root, load

    source = HERE / SOURCES[name]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())  # torch's own override
    build_dir = root / f"{python}-torch{torch.__version__}-{host_isa().build_key}-{_headers_key()}" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir)
    try:
        load(name, [str(source)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, build_directory=str(build_dir),
             extra_include_paths=[str(HERE)], is_python_module=False)
    except Exception as exc:  # no compiler, no ninja, ...
        logger.warning("kvloom CPU kernel %s unavailable (%s); using the torch fallback", source.name, exc)
        return None
    return torch.ops.kvloom


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for extension in SOURCES:
        print(extension, "ready" if build_extension(extension) is not None else "unavailable (torch fallback)")
