"""Replicas over time, as the router sees them come and go, with the load signals at each change: what
`kvloom status` shows to say when the deployment scaled and on what.

Serve's autoscaler decides on these signals averaged over its look-back window (cluster/autoscaling_policy.py);
the figures here are the router's at the moment a replica joined or left.
"""

import time
from collections import deque
from dataclasses import asdict, dataclass

from kvloom.router.replica_table import ReplicaState

KEPT_EVENTS = 50


@dataclass
class ScalingEvent:
    time: float  # wall clock
    replicas: int  # after the change
    joined: list[str]
    left: list[str]
    queued: int  # in the router
    waiting_per_replica: float  # in the engines and the router, per replica before the change
    running: int
    kv_usage: float  # mean over the replicas before the change
    ttft_p90_s: float


class ScalingLog:
    def __init__(self) -> None:
        self.events: deque[ScalingEvent] = deque(maxlen=KEPT_EVENTS)
        self._known: dict[str, ReplicaState] = {}

    def observe(self, live: list[ReplicaState], queued: int, ttft_p90_s: float) -> None:
        """Record a change in the live replicas since the last call (called on every stats push)."""
        current = {r.replica_id: r for r in live}
        joined, left = sorted(current.keys() - self._known.keys()), sorted(self._known.keys() - current.keys())
        if joined or left:
            before = list(self._known.values())
            waiting = sum(r.stats.num_waiting for r in before) + queued
            self.events.append(ScalingEvent(
                time.time(), len(current), joined, left, queued, waiting / max(1, len(before)),
                sum(r.stats.num_running for r in before),
                sum(r.stats.kv_cache_usage for r in before) / len(before) if before else 0.0, ttft_p90_s))
        self._known = current

    def as_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]
