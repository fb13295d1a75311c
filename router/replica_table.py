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

A request goes to the replica that reaches the longest prefix of its prompt among those busier than
the least loaded one by at most `imbalance_threshold`; to the least loaded where none reaches any. A
replica reaches a block in its KV pool, or (with KV tiers, engine/kv_tiers/) in its node's tiers,
which every replica of the node shares and reports: such a block counts TIER_HIT_WEIGHT of a pool
block, so the pool's holder wins while it is not too busy, and when it is, a replica that loads the
prefix from the node's tier wins over one that would compute it. A LoRA adapter's request looks among
the replicas holding the adapter first, and goes to another (which loads it) only when none of those
has credit left.
"""

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from kvloom.replicas.messages import ReplicaStats

PREEMPTION_HEADROOM = 2  # a replica's in-flight cap, in multiples of its credit, when preempting
RETIRED_MEMORY_S = 600.0  # how long a retired replica's stats pushes are ignored (it ends long before)
SENT_MEMORY_S = 10.0  # how long an adapter or a prompt's blocks sent to a replica count as held there without its
# report saying so
ACTIVE_TENANT_S = 10.0  # a tenant in flight on a replica this recently shares its slots (a steady client between
# two of its requests is still there)
TIER_HIT_WEIGHT = 0.5  # a prefix block in the node's KV tiers against one in the pool: copied in, not computed, but
# the copy is not free and the tier may have lost the block since its report


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
    tiered: set[int] = field(default_factory=set)  # blocks its node's KV tiers hold, as it reported (and was sent)

    @property
    def has_tiers(self) -> bool:
        """It runs KV tiers: it reads its node's, and writes the blocks it computes there."""
        return self.stats.kv_tiers is not None

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

    def affinity(self, prompt_hashes: list[int], node_tiers: list[set[int]]) -> float:
        """The prompt's leading blocks this replica reaches: those in its pool, then TIER_HIT_WEIGHT for each
        further one that some replica of its node reported in the node's tiers (`node_tiers`), as the engine
        looks them up (engine/kv_cache_manager.py)."""
        pooled = self.prefix_match(prompt_hashes)
        tiered = 0
        if self.has_tiers:
            for block_hash in prompt_hashes[pooled:]:
                if not any(block_hash in tier for tier in node_tiers):
                    break
                tiered += 1
        return pooled + TIER_HIT_WEIGHT * tiered


class ReplicaTable:
    def __init__(self, slack: int = 4, imbalance_threshold: int = 8, stale_after_s: float = 5.0,
                 deployment_id: str | None = None) -> None:
        """`deployment_id`: the app deployment whose replicas this table follows (cluster/app.py); stats of
        another's (an earlier deployment's replica, which Serve is still stopping, pushing to the new router) are
        not recorded."""
        self.slack = slack
        self.imbalance_threshold = imbalance_threshold
        self.stale_after_s = stale_after_s
        self.deployment_id = deployment_id
        self.replicas: dict[str, ReplicaState] = {}
        self.retired: dict[str, float] = {}  # replica -> when it left; its last stats pushes are ignored
        self.serving: frozenset[str] | None = None  # the replicas Serve routes to (None: not known yet)

    def report(self, stats: ReplicaStats) -> None:
        replica_id = stats.replica_id
        if replica_id in self.retired or stats.deployment_id != self.deployment_id:
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
        state.tiered = set(stats.tier_prefix_hashes)
        if state.has_tiers:  # what it was sent is written through to its tier as it is computed
            state.tiered.update(state.prefixes_sent)
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
        near = [r for r in open_replicas if r.load - least.load <= self.imbalance_threshold]
        tiers = self.node_tiers()
        reach = {r.replica_id: r.affinity(prompt_hashes, tiers[r.stats.node_id]) for r in near}
        best = max(near, key=lambda r: (reach[r.replica_id], -r.load))
        return best if reach[best.replica_id] > 0 else least

    def node_tiers(self) -> dict[str, list[set[int]]]:
        """Node -> what its live replicas report its KV tiers hold (they share them: one set each, not merged, as
        this runs for every request)."""
        tiers = defaultdict(list)
        for replica in self.replicas.values():
            if replica.tiered:
                tiers[replica.stats.node_id].append(replica.tiered)
        return tiers

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
        if replica.has_tiers:
            replica.tiered.update(prompt_hashes)  # and its node's tiers, as it computes them
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
