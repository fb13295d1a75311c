"""kvloom: an LLM serving cluster (see README.md).

Importing kvloom before torch gives the process kvloom's OpenMP wait settings (engine/cpu_threads.py):
libgomp reads them only when torch loads it.
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    from kvloom.engine.cpu_threads import openmp_env as _openmp_env

    _os.environ.update(_openmp_env())
