"""A server as a whole process tree: a server is many processes (vLLM's engine core, Ray's raylet, GCS and
workers). Its peak resident memory is their sum, not the largest one's, and stopping it means all of them."""

import signal
import subprocess
import threading
import time

import psutil

# Listing a tree walks all of /proc (~3-5 ms of CPU): at 4 Hz the sampler took ~0.02 core from the 2-core hosts
# the servers under test run on (measured during `kvloom serve` on W1). A server's RSS plateaus once its KV
# cache and weights are in, so once a second loses nothing that matters.
SAMPLE_S = 1.0


def tree_rss_mb(pid: int) -> float:
    """The summed RSS of `pid` and every descendant alive now (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class PeakTreeRSS:
    """Samples a tree's summed RSS in a background thread until stopped; `peak_mb` is the largest sum."""

    def __init__(self, pid: int, period_s: float = SAMPLE_S) -> None:
        self.pid = pid
        self.period_s = period_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"rss-{pid}")

    def __enter__(self) -> "PeakTreeRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, tree_rss_mb(self.pid))
            self._stop.wait(self.period_s)


def wait_for(predicate, timeout_s: float, period_s: float = 0.5) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return False


def stop_tree(process: subprocess.Popen) -> None:
    """SIGINT the server (its Ctrl-C), then terminate and kill whatever of its tree is left."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
    process.wait()
