"""Builds kvloom's C++ CPU kernels once per machine with torch's JIT extension loader.

Sources sit next to this file; torch caches the build (keyed by the source's hash) under
~/.cache/torch_extensions, so only the first process on a machine pays the compile.
"""

import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++20"]


@functools.cache
def build_extension(name: str, source: str):
    """The compiled module, or None (with a warning) where it cannot be built: callers stay correct, just slower."""
    from torch.utils.cpp_extension import load

    try:
        return load(name, [str(Path(__file__).with_name(source))], extra_cflags=CFLAGS)
    except Exception as exc:  # no compiler, no ninja, ...
        logger.warning("kvloom CPU kernel %s unavailable (%s); using the torch fallback", source, exc)
        return None
