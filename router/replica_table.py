"""What the router knows of each replica, and which one a request should go to.

Replicas push stats every fraction of a second; one that stops reporting is dropped. Each has
credit = its max_num_seqs plus a small slack: the router never sends more than that, so
requests queue (and get ordered) in the router instead of in replica mailboxes. A request goes
to the replica holding the longest cached prefix of its prompt, unless that replica is busier
than the least loaded one by more than `imbalance_threshold`; otherwise to the least loaded.
"""

import time
from dataclasses import dataclass, field


@dataclass
class ReplicaState:
    replica_id: str
    stats: dict
    last_seen: float
    inflight: int = 0  # requests this router has dispatched and not yet seen finish
    dispatched: int = 0
    cached: set[int] = field(default_factory=set)

    def capacity(self, slack: int) -> int:
        return int(self.stats.get("max_num_seqs", 1)) + slack

    @property
    def load(self) -> int:
        return self.inflight

    def prefix_match(self, prompt_hashes: list[int]) -> int:
        """How many leading blocks of the prompt this replica holds."""
        matched = 0
        for block_hash in prompt_hashes:
            if block_hash not in self.cached:
                break
            matched += 1
        return matched


class ReplicaTable:
    def __init__(self, slack: int = 4, imbalance_threshold: int = 8, stale_after_s: float = 5.0) -> None:
        self.slack = slack
        self.imbalance_threshold = imbalance_threshold
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, ReplicaState] = {}

    def report(self, stats: dict) -> None:
        replica_id = stats["replica_id"]
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id, stats, time.monotonic())
        state.stats, state.last_seen = stats, time.monotonic()
        state.cached = set(stats.get("cached_prefix_hashes", ()))
        if not stats.get("healthy", True):
            self.drop(replica_id)

    def drop(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def live(self) -> list[ReplicaState]:
        now = time.monotonic()
        for replica_id in [r for r, s in self.replicas.items() if now - s.last_seen > self.stale_after_s]:
            self.drop(replica_id)
        return list(self.replicas.values())

    def choose(self, prompt_hashes: list[int]) -> ReplicaState | None:
        """The replica for a request, or None when no replica has credit left."""
        open_replicas = [r for r in self.live() if r.inflight < r.capacity(self.slack)]
        if not open_replicas:
            return None
        least = min(open_replicas, key=lambda r: (r.load, r.dispatched))
        best = max(open_replicas, key=lambda r: (r.prefix_match(prompt_hashes), -r.load))
        if best.prefix_match(prompt_hashes) > 0 and best.load - least.load <= self.imbalance_threshold:
            return best
        return least

    def take(self, replica: ReplicaState, prompt_hashes: list[int]) -> None:
        replica.inflight += 1
        replica.dispatched += 1
        replica.cached.update(prompt_hashes)  # it will hold this prefix long before its next report

    def give_back(self, replica: ReplicaState) -> None:
        replica.inflight = max(0, replica.inflight - 1)
