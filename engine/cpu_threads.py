"""How many intra-op threads a CPU engine gets, and how its OpenMP pool waits between ops.

A decode step is hundreds of short parallel regions (four GEMMs, attention and a few elementwise
passes per layer), with only microseconds of Python between them. Under OMP_WAIT_POLICY=PASSIVE every
region wakes its sleeping workers through the kernel, ~70 us each on this project's 2-core hosts: a
batch-1 bfloat16 step took 32 ms that way and 19 ms with a bounded spin (batch 64: 95 vs 62 ms,
measured). GOMP's default spin (~3 ms by its own estimate of 100,000 spins a millisecond) would take
a core from the HTTP router and proxy between steps; a tenth of it (GOMP_SPINCOUNT=30000, ~0.3 ms)
bridges the gaps inside a step as well (19.1 vs 18.7 ms under OMP_WAIT_POLICY=ACTIVE at batch 1) and
still sleeps between steps. libgomp reads these once, when it loads: they must be in the
environment before torch is imported (kvloom's package sets its defaults then, and replicas get them
through their Ray runtime environment).
"""

import os

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000"}


def openmp_env() -> dict[str, str]:
    """kvloom's OpenMP settings for a new process, leaving any the operator chose."""
    return {key: os.environ.get(key, value) for key, value in OPENMP_DEFAULTS.items()}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers and Ray may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_of_node(cpus: int, replicas_on_node: int) -> int:
    """Threads for one of `replicas_on_node` engines sharing `cpus` cores: an even split, at least one."""
    return max(1, cpus // max(1, replicas_on_node))
