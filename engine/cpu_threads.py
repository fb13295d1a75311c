"""How many intra-op threads a CPU engine gets, and how its OpenMP pool waits between ops.

A decode step is hundreds of short parallel regions with only microseconds of Python between them. Under
OMP_WAIT_POLICY=PASSIVE every region wakes its sleeping workers through the kernel, and where the engine shares
its cores with the router and clients a worker that sleeps too soon pays that wake-up on top of being
descheduled; so kvloom asks for GOMP_SPINCOUNT=300000 (~3 ms, libgomp's own default when no policy is set)
explicitly, for every process it starts (the measured sweep: docs/performance.md). An operator's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept. libgomp reads these once, when it loads: they must be in the
environment before torch is imported (kvloom's package sets its defaults then, and replicas get them through
their Ray runtime environment). Where every linear is kvloom's own GEMM, its kernels run on a pool of their own
instead of this team, which keeps one thread (kernels/item_pool.py).
"""

import ctypes
import os

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "300000"}
PR_SET_NAME = 15  # prctl option (linux/prctl.h)
ENGINE_THREAD_NAME = "kvloom-engine"  # an engine loop's thread, and the OpenMP workers it starts


def openmp_env() -> dict[str, str]:
    """kvloom's OpenMP settings for a new process: none where the operator chose a wait policy, else the
    defaults under any value the operator set."""
    if "OMP_WAIT_POLICY" in os.environ:
        return {}
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


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (up to 15 bytes) where the OS shows it (`top -H`, /proc, py-spy), on Linux;
    the OpenMP workers it starts inherit it, so an engine's threads can be told from Ray's in its process."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def schedule_normally() -> None:
    """Move the calling thread, and so the pool and OpenMP workers it starts, from Linux's SCHED_BATCH class
    (which `kvloom serve`'s own Ray cluster runs in, see cluster/serve_command.py) back to the normal one: an
    engine thread that wakes (a pool worker given items, the step loop taking the GIL back) must preempt Ray's
    batch threads, not wait for the next tick behind them."""
    try:
        if os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        pass
