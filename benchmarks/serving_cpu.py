"""Whose CPU a served run used: every thread's CPU time from /proc, summed by its role in `kvloom serve`.

On a host where the engine's threads fill every core, each CPU second that another process takes comes out of
the engine's, so a served run's shortfall against the offline engine is read here process by process: the
router, the replica's threads beside its engine, the client, Serve's controller and proxy, Ray's daemons.
"""

import os
from collections import Counter
from pathlib import Path

from kvloom.engine.cpu_threads import ENGINE_THREAD_NAME

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ENGINE_THREADS = "engine replica: engine threads"
ROLES = (("ServeReplica:kvloom:Router", "router"), ("ProxyActor", "Serve proxy"),
         ("ServeController", "Serve controller"), ("raylet", "raylet"), ("gcs_server", "GCS"),
         ("dashboard", "dashboard agent"), ("log_monitor", "log monitor"),
         ("kvloom.cluster.cli serve", "`kvloom serve` driver"))

NOT_SERVING = (ENGINE_THREADS, "other")  # the engine itself, and the host's processes that serve nothing

# (pid, tid) -> the process's command line, the thread's name, its CPU seconds so far and its start (clock ticks
# after boot: a thread id the OS reused belongs to another thread)
ThreadTimes = dict[tuple[int, int], tuple[str, str, float, int]]


def own_cpu_seconds() -> float:
    """This process's user+system CPU so far, threads that ended included (the client's share)."""
    times = os.times()
    return times.user + times.system


def _cpu_seconds(stat_fields: list[str]) -> float:
    """User + system CPU seconds from a /proc stat line's fields after the command name."""
    return (int(stat_fields[11]) + int(stat_fields[12])) / CLOCK_TICKS


def process_cpu_seconds(pid: int) -> float:
    """A process's user+system CPU seconds so far, all its threads together."""
    return _cpu_seconds(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())


def thread_cpu_seconds() -> ThreadTimes:
    """Every thread's process command line, thread name, user+system CPU seconds so far and start time."""
    seen = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                seen[int(pid), int(tid)] = (cmdline, name, _cpu_seconds(fields), int(fields[19]))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return seen


def role(cmdline: str, thread: str) -> str:
    if "ServeReplica:kvloom:EngineReplica" in cmdline:
        return ENGINE_THREADS if thread == ENGINE_THREAD_NAME else "engine replica: other threads"
    return next((name for marker, name in ROLES if marker in cmdline), "other")


CLIENT = "client (the benchmark, aiohttp)"


def cpu_by_role(before: ThreadTimes, after: ThreadTimes, client_pid: int, client_s: float,
                client: str = CLIENT) -> dict[str, float]:
    """CPU seconds between two snapshots by role; the client's (process `client_pid`, `client_s`) is counted
    apart, named `client`. Threads that started between the snapshots are left out. A thread is known by its start
    time, not its process's command line: Ray retitles a worker with the method it runs (`ray::ServeController`,
    then `ray::ServeController.listen_for_change`), which once dropped a whole process from a run's count."""
    by_role = Counter()
    for (pid, tid), (cmdline, thread, cpu, started) in after.items():
        if pid != client_pid and (pid, tid) in before and before[pid, tid][3] == started:
            by_role[role(cmdline, thread)] += cpu - before[pid, tid][2]
    by_role[client] = client_s
    return {name: round(cpu, 3) for name, cpu in by_role.most_common() if cpu >= 0.005}


def beside_engine(cpu: dict[str, float]) -> float:
    """What the serving path took beside the engine's threads (the host's other processes left out)."""
    return sum(seconds for name, seconds in cpu.items() if name not in NOT_SERVING)


def serving_cpu_line(cpu: dict[str, float]) -> str:
    """One sentence: the engine threads' CPU in a served run, and what every role beside them took."""
    beside = ", ".join(f"{name} {seconds:.2f}" for name, seconds in cpu.items()
                       if name not in NOT_SERVING and seconds >= 0.05)
    return (f"CPU during the run: engine threads {cpu.get(ENGINE_THREADS, 0.0):.1f} s; beside them "
            f"{beside_engine(cpu):.2f} s ({beside})")
