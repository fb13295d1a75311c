"""What the router knows of each replica, and which one a request should go to.

Replicas push stats every fraction of a second; one that stops reporting is dropped. Each has
credit = its max_num_seqs plus a small slack: the router never sends more than that, so
requests queue (and get ordered) in the router instead of in replica mailboxes.

Two exceptions let a request past a full replica, both resolved by the engine's priority
preemption, and both capped at PREEMPTION_HEADROOM x credit in flight:
- credit is counted per priority class: lower classes do not use up a better class's credit, so
  a high-priority request never waits in the router behind a batch of lower ones;
- fair-share preemption: a tenant holding fewer of the replica's slots than its weighted share
  (among the tenants in flight there) while another holds more may go in, so a light tenant
  does not wait for a flooder's request to finish. Such a request is "boosted" (with credit or
  without): the engine runs it before the others of its class.

A request goes to the replica holding the longest cached prefix of its prompt, unless that
replica is busier than the least loaded one by more than `imbalance_threshold`; otherwise to the
least loaded. A LoRA adapter's request looks among the replicas holding the adapter first, and goes
to another (which loads it) only when none of those has credit left.
"""

import time
from collections import Counter
from dataclasses import dataclass, field

from kvloom.replicas.messages import ReplicaStats

PREEMPTION_HEADROOM = 2  # a replica's in-flight cap, in multiples of its credit, when preempting
RETIRED_MEMORY_S = 600.0  # how long a retired replica's stats pushes are ignored (it ends long before)
SENT_MEMORY_S = 10.0  # how long an adapter or a prompt's blocks sent to a replica count as held there without its
# report saying so
ACTIVE_TENANT_S = 10.0  # a tenant in flight on a replica this recently shares its slots (a steady client between
# two of its requests is still there)


@dataclass
class ReplicaState:
    replica_id: str
    stats: ReplicaStats
    last_seen: float
    inflight: int = 0  # requests this router has dispatched and not yet seen finish
    dispatched: int = 0
    cached: set[int] = field(default_factory=set)
    classes: Counter = field(default_factory=Counter)  # in-flight requests per priority class
    tenants: Counter = field(default_factory=Counter)  # in-flight requests per tenant
    weights: dict[str, float] = field(default_factory=dict)  # of the tenants in flight
    recent: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (weight, last time in flight)
    adapters: set[str] = field(default_factory=set)  # LoRA adapters it reported holding
    adapters_sent: dict[str, float] = field(default_factory=dict)  # adapters sent there and not reported yet: when
    prefixes_sent: dict[int, float] = field(default_factory=dict)  # block hashes likewise (a report built before a
    # prompt's blocks were cached would otherwise wipe them, and its group's next prompt would go elsewhere)

    def capacity(self, slack: int) -> int:
        return self.stats.max_num_seqs + slack

    def has_headroom(self, slack: int) -> bool:
        return self.inflight < PREEMPTION_HEADROOM * self.capacity(slack)

    def has_room(self, slack: int, priority: int) -> bool:
        """Credit left for a request of this class: only classes at least as good count against it."""
        as_good = sum(n for p, n in self.classes.items() if p <= priority)
        return as_good < self.capacity(slack) and self.has_headroom(slack)

    def below_share(self, slack: int, tenant: str, weight: float) -> bool:
        """One more request keeps `tenant` within its weighted share of the slots, and someone is over theirs."""
        weights = {**self.weights, tenant: weight}
        unit = self.capacity(slack) / sum(weights.values())
        within = self.tenants[tenant] + 1 <= unit * weight
        someone_over = any(n > unit * weights[t] for t, n in self.tenants.items() if t != tenant)
        return within and someone_over and self.has_headroom(slack)

    def crowds(self, slack: int, tenant: str, weight: float, now: float) -> bool:
        """One more request puts `tenant` over its weighted share of the slots among the tenants active here lately:
        its prompts yield to theirs (engine/prefill_yield.py). A tenant alone on the replica never does, nor a
        tenant's first request there (with more tenants than slots a share is under one slot)."""
        active = {t: w for t, (w, seen) in self.recent.items() if self.tenants[t] or now - seen < ACTIVE_TENANT_S}
        active[tenant] = weight
        if len(active) < 2:
            return False
        return self.tenants[tenant] + 1 > max(1.0, self.capacity(slack) / sum(active.values()) * weight)

    def holds_adapter(self, name: str) -> bool:
        """It reported the adapter, or got a request for it lately (a report may be older than that request)."""
        return name in self.adapters or time.monotonic() - self.adapters_sent.get(name, -SENT_MEMORY_S) < SENT_MEMORY_S

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
        self.retired: dict[str, float] = {}  # replica -> when it left; its last stats pushes are ignored
        self.serving: frozenset[str] | None = None  # the replicas Serve routes to (None: not known yet)

    def report(self, stats: ReplicaStats) -> None:
        replica_id = stats.replica_id
        if replica_id in self.retired:
            return
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id, stats, time.monotonic())
        now = time.monotonic()
        state.stats, state.last_seen = stats, now
        state.cached = set(stats.cached_prefix_hashes)
        state.prefixes_sent = {h: t for h, t in state.prefixes_sent.items()
                               if now - t < SENT_MEMORY_S and h not in state.cached}
        state.cached.update(state.prefixes_sent)
        state.adapters = set(stats.lora_adapters)
        state.adapters_sent = {a: t for a, t in state.adapters_sent.items() if a not in state.adapters}
        if not stats.healthy:
            self.drop(replica_id)

    def drop(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def retire(self, replica_id: str) -> None:
        """The replica is leaving: no new request goes there, and what it caches no longer attracts any."""
        now = time.monotonic()
        self.retired = {r: t for r, t in self.retired.items() if now - t < RETIRED_MEMORY_S}
        self.retired[replica_id] = now
        self.drop(replica_id)

    def live(self) -> list[ReplicaState]:
        now = time.monotonic()
        for replica_id in [r for r, s in self.replicas.items() if now - s.last_seen > self.stale_after_s]:
            self.drop(replica_id)
        return list(self.replicas.values())

    def routable(self) -> list[ReplicaState]:
        """The live replicas Serve routes to: one that reports while Serve still starts it takes no request yet
        (Serve would send it to another replica). All live ones until Serve's set is known."""
        return [r for r in self.live() if self.serving is None or r.replica_id in self.serving]

    def choose(self, prompt_hashes: list[int], priority: int = 0, adapter: str | None = None) -> ReplicaState | None:
        """The replica for a request, or None when no replica has credit left for its class."""
        open_replicas = [r for r in self.routable() if r.has_room(self.slack, priority)]
        if not open_replicas:
            return None
        if adapter is not None:
            open_replicas = [r for r in open_replicas if r.holds_adapter(adapter)] or open_replicas
        least = min(open_replicas, key=lambda r: (r.load, r.dispatched))
        best = max(open_replicas, key=lambda r: (r.prefix_match(prompt_hashes), -r.load))
        if best.prefix_match(prompt_hashes) > 0 and best.load - least.load <= self.imbalance_threshold:
            return best
        return least

    def max_model_len(self) -> int:
        return max((r.stats.max_model_len for r in self.live()), default=0)

    def choose_below_share(self, tenant: str, weight: float) -> ReplicaState | None:
        """The least loaded replica where `tenant` may preempt for its fair share of slots, if any."""
        candidates = [r for r in self.routable() if self.is_below_share(r, tenant, weight)]
        return min(candidates, key=lambda r: r.load, default=None)

    def is_below_share(self, replica: ReplicaState, tenant: str, weight: float) -> bool:
        return replica.below_share(self.slack, tenant, weight)

    def crowds(self, replica: ReplicaState, tenant: str, weight: float) -> bool:
        return replica.crowds(self.slack, tenant, weight, time.monotonic())

    def take(self, replica: ReplicaState, prompt_hashes: list[int], priority: int = 0, tenant: str = "default",
             weight: float = 1.0, adapter: str | None = None) -> None:
        replica.inflight += 1
        replica.dispatched += 1
        replica.classes[priority] += 1
        replica.tenants[tenant] += 1
        replica.weights[tenant] = weight
        replica.recent[tenant] = (weight, time.monotonic())
        replica.cached.update(prompt_hashes)  # it will hold this prefix long before its next report
        replica.prefixes_sent.update(dict.fromkeys(prompt_hashes, time.monotonic()))
        if adapter is not None:
            replica.adapters_sent[adapter] = time.monotonic()  # and this adapter

    def give_back(self, replica: ReplicaState, priority: int = 0, tenant: str = "default") -> None:
        replica.inflight = max(0, replica.inflight - 1)
        for counter, key in ((replica.classes, priority), (replica.tenants, tenant)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
        if tenant in replica.recent:
            replica.recent[tenant] = (replica.recent[tenant][0], time.monotonic())
        if tenant not in replica.tenants:
            replica.weights.pop(tenant, None)
