"""Prometheus metrics (prefix `kvloom:`), one registry per router instance.

Request-level series (tokens, latencies) are observed by the router as it streams; engine-level
series (running, waiting, KV usage, prefix cache, preemptions) come from the replicas' latest
stats at scrape time.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvloom.router.replica_table import ReplicaTable

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ReplicaStatsCollector:
    def __init__(self, table: ReplicaTable) -> None:
        self.table = table

    def collect(self):
        gauges = {
            "num_requests_running": GaugeMetricFamily("kvloom:num_requests_running", "Requests in engine batches", labels=["replica"]),
            "num_requests_waiting": GaugeMetricFamily("kvloom:num_requests_waiting", "Requests waiting in engines", labels=["replica"]),
            "kv_cache_usage_perc": GaugeMetricFamily("kvloom:kv_cache_usage_perc", "Fraction of KV blocks in use", labels=["replica"]),
        }
        counters = {
            "prefix_cache_queries": CounterMetricFamily("kvloom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=["replica"]),
            "prefix_cache_hits": CounterMetricFamily("kvloom:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=["replica"]),
            "num_preemptions": CounterMetricFamily("kvloom:num_preemptions", "Requests preempted by recompute", labels=["replica"]),
            "engine_steps": CounterMetricFamily("kvloom:engine_steps", "Engine steps that ran a batch", labels=["replica"]),
            "engine_step_requests": CounterMetricFamily(
                "kvloom:engine_step_requests", "Requests computed, summed over steps (over engine_steps: the mean batch)",
                labels=["replica"]),
            "engine_step_seconds": CounterMetricFamily(
                "kvloom:engine_step_seconds", "Seconds the engine spent in steps (its rate: how busy it is)",
                labels=["replica"]),
        }
        spec = {  # vLLM's names; only replicas that speculate report them
            "num_drafts": CounterMetricFamily("kvloom:spec_decode_num_drafts", "Requests given drafted tokens in a step", labels=["replica"]),
            "num_draft_tokens": CounterMetricFamily("kvloom:spec_decode_num_draft_tokens", "Drafted tokens verified", labels=["replica"]),
            "num_accepted_tokens": CounterMetricFamily("kvloom:spec_decode_num_accepted_tokens", "Drafted tokens kept", labels=["replica"]),
        }
        tiers = {  # replicas with KV tiers only, per tier (host, disk)
            "hits": CounterMetricFamily("kvloom:kv_tier_hits", "KV blocks read back from a tier", labels=["replica", "tier"]),
            "misses": CounterMetricFamily("kvloom:kv_tier_misses", "KV blocks looked up in a tier and not found", labels=["replica", "tier"]),
            "blocks_written": CounterMetricFamily("kvloom:kv_tier_blocks_written", "KV blocks written to a tier", labels=["replica", "tier"]),
            "bytes_read": CounterMetricFamily("kvloom:kv_tier_read_bytes", "Bytes of KV read back from a tier", labels=["replica", "tier"]),
            "load_s": CounterMetricFamily("kvloom:kv_tier_load_seconds", "Seconds spent reading a tier", labels=["replica", "tier"]),
            "used_bytes": GaugeMetricFamily("kvloom:kv_tier_used_bytes", "Bytes a tier holds (the node's, as this replica sees it)", labels=["replica", "tier"]),
        }
        per_position = CounterMetricFamily("kvloom:spec_decode_num_accepted_tokens_per_pos",
                                           "Drafted tokens kept, by position in the draft", labels=["replica", "position"])
        for replica in self.table.live():
            s = replica.stats
            gauges["num_requests_running"].add_metric([replica.replica_id], s.num_running)
            gauges["num_requests_waiting"].add_metric([replica.replica_id], s.num_waiting)
            gauges["kv_cache_usage_perc"].add_metric([replica.replica_id], s.kv_cache_usage)
            for name, family in counters.items():
                family.add_metric([replica.replica_id], getattr(s, name))
            if s.spec_decode:
                for name, family in spec.items():
                    family.add_metric([replica.replica_id], s.spec_decode[name])
                for position, count in enumerate(s.spec_decode["num_accepted_tokens_per_pos"]):
                    per_position.add_metric([replica.replica_id, str(position)], count)
            for tier, figures in ((s.kv_tiers or {}).items()):
                if isinstance(figures, dict):  # not restore_s, the engine's own
                    for name, family in tiers.items():
                        family.add_metric([replica.replica_id, tier], figures[name])
        yield from gauges.values()
        yield from tiers.values()
        yield from counters.values()
        yield from spec.values()
        yield per_position


class RouterMetrics:
    def __init__(self, table: ReplicaTable) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ReplicaStatsCollector(table))
        r = self.registry
        self.router_queued = Gauge("kvloom:router_queue_length", "Requests waiting in the router", registry=r)
        # `lora`: the request's LoRA adapter ("" for the base model)
        self.requests = Counter("kvloom:requests", "Finished requests", ["tenant", "finish_reason", "replica", "lora"],
                                registry=r)
        self.prompt_tokens = Counter("kvloom:prompt_tokens", "Prompt tokens processed", ["tenant", "lora"], registry=r)
        self.generation_tokens = Counter("kvloom:generation_tokens", "Tokens generated", ["tenant", "lora"], registry=r)
        self.ttft = Histogram("kvloom:time_to_first_token_seconds", "Time to first token", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvloom:time_per_output_token_seconds", "Time per output token after the first", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvloom:e2e_request_latency_seconds", "Request latency", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvloom:request_queue_time_seconds", "Time queued in the router", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.moved = Counter("kvloom:requests_moved", "Requests moved off a failed replica: retried (nothing "
                             "streamed yet) or continued (mid-stream)", ["tenant", "how"], registry=r)
        self.cold_start = Histogram("kvloom:cold_start_seconds", "From a request finding no replica to one "
                                    "ready", buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("kvloom:rejected_requests", "Requests refused or failed, by reason (quota name or error code)", ["tenant", "reason"], registry=r)
        self.tenant_queued = Gauge("kvloom:tenant_queued_requests", "Requests waiting in the router", ["tenant"], registry=r)
        self.virtual_counter = Gauge("kvloom:tenant_virtual_counter", "VTC weighted service per tenant", ["tenant"], registry=r)

    def observe_tenants(self, tenants: list[str], queued: dict[str, int], counters: dict[str, float]) -> None:
        """Scrape-time per-tenant gauges (every known tenant, zeros included)."""
        for tenant in tenants:
            self.tenant_queued.labels(tenant).set(queued.get(tenant, 0))
            self.virtual_counter.labels(tenant).set(counters.get(tenant, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
