"""How many intra-op threads a CPU engine gets, and how its OpenMP pool waits between ops.

A decode step is hundreds of short parallel regions (four GEMMs, attention and a few elementwise
passes per layer), with only microseconds of Python between them. Under OMP_WAIT_POLICY=PASSIVE every
region wakes its sleeping workers through the kernel, ~70 us each on this project's 2-core hosts: a
batch-1 bfloat16 step took 32 ms that way and 19 ms spinning (batch 64: 95 vs 62 ms, measured). How
long to spin matters most when the engine shares its cores with the HTTP router, proxy and clients:
a worker that is descheduled mid-region leaves its partner waiting, and one that sleeps too soon pays
the wake-up on top. `kvloom serve` on W1 over HTTP: 310 out tok/s at GOMP_SPINCOUNT=3000, 316 at
30000, 342 at 300000 (~3 ms by libgomp's own estimate of 100,000 spins a millisecond), 346 at 3M and
344 spinning forever; so kvloom asks for 300000 (libgomp's default when no policy is set) explicitly,
for every process it starts. An operator's own OMP_WAIT_POLICY (a PASSIVE among them) or GOMP_SPINCOUNT
is kept. libgomp reads these once, when it loads: they must be in the environment
before torch is imported (kvloom's package sets its defaults then, and replicas get them through their
Ray runtime environment). Where every linear is kvloom's own GEMM, its kernels run on a pool of their own
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
