"""kvloom's autoscaling policy, run by Serve's own autoscaler on the signals each replica reports.

Serve's default policy scales on ongoing requests per replica, which for kvloom stays near one whatever the
backlog: requests reach a replica through short `submit` calls and stream back over one long-lived channel per
router. Each replica instead reports (`EngineReplica.record_autoscaling_stats`) the requests waiting for a
slot, its own and its share of the router's queue, its running requests, its KV use and the router's p90 time
to first token; this policy turns the configured target into a replica count. Serve applies the bounds and the
upscale and downscale delays to what it returns, and scales from zero itself (router/cold_start.py).
"""

import math

WAITING = "waiting_per_replica"
KV_USAGE = "kv_usage"
TTFT = "ttft_p90_s"
SERVE_POLICY = "kvloom.cluster.autoscaling_policy:LoadSignalPolicy"


class LoadSignalPolicy:
    """Replicas for one signal and its target per replica.

    waiting_per_replica: more replicas when the mean number waiting is over the target, as many more as would
    bring it to the target. ttft_p90_s: more in proportion when the p90 is over the target. kv_usage:
    proportional, both ways. The first two give replicas back only when everything running and waiting would
    fill fewer replicas' `max_num_seqs` slots (a replica busy with no queue keeps its place).
    """

    def __init__(self, signal: str, target: float, max_num_seqs: int) -> None:
        self.signal, self.target, self.max_num_seqs = signal, target, max_num_seqs

    def desired(self, replicas: int, reported: dict[str, dict]) -> int:
        """The replica count for what `replicas` replicas reported (metric -> replica -> value)."""
        if self.signal == KV_USAGE:
            usage = list(reported.get(KV_USAGE, {}).values())
            return math.ceil(replicas * (sum(usage) / len(usage)) / self.target) if usage else replicas
        waiting = sum(reported.get("waiting", {}).values())
        running = sum(reported.get("running", {}).values())
        if self.signal == TTFT:
            ttft = max(reported.get(TTFT, {}).values(), default=0.0)  # each replica reports the router's figure
            if ttft > self.target:
                return math.ceil(replicas * ttft / self.target)
        elif waiting > self.target * replicas:
            return math.ceil(waiting / self.target)
        return min(replicas, math.ceil((running + waiting) / self.max_num_seqs))

    def __call__(self, ctx) -> tuple[int, dict]:
        """Serve's entry point: `ctx` is its AutoscalingContext (metrics averaged over its look-back window)."""
        reported = ctx.aggregated_metrics or {}
        if not reported or ctx.current_num_replicas == 0:
            return ctx.target_num_replicas, {}
        return self.desired(ctx.current_num_replicas, reported), {}


def serve_autoscaling_config(settings, max_num_seqs: int) -> dict:
    """Serve's `autoscaling_config` for kvloom's `autoscaling` settings (cluster/config.py)."""
    return {
        "min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
        "upscale_delay_s": settings.upscale_delay_s, "downscale_delay_s": settings.downscale_delay_s,
        "downscale_to_zero_delay_s": settings.downscale_delay_s,
        "metrics_interval_s": 1.0, "look_back_period_s": settings.look_back_s,
        "policy": {"policy_function": SERVE_POLICY, "policy_kwargs": {
            "signal": settings.target.signal, "target": getattr(settings.target, settings.target.signal),
            "max_num_seqs": max_num_seqs}},
    }
