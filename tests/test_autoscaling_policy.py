"""kvloom's autoscaling policy turns what replicas report into a replica count: more when requests wait over the
target or the time to first token is over it, fewer only when the load would fill fewer replicas, KV use
proportional both ways. Serve applies the bounds and delays; `test_autoscaling.py` runs it under Serve."""

from types import SimpleNamespace

import pytest

from kvloom.cluster.autoscaling_policy import KV_USAGE, TTFT, WAITING, LoadSignalPolicy, serve_autoscaling_config
from kvloom.cluster.config import AutoscalingSettings
from kvloom.router.recent_ttft import RecentTTFT


def reports(**per_metric: list[float]) -> dict[str, dict]:
    return {metric: {f"replica-{i}": v for i, v in enumerate(values)} for metric, values in per_metric.items()}


def test_a_backlog_over_the_target_asks_for_as_many_replicas_as_bring_it_to_the_target():
    policy = LoadSignalPolicy(WAITING, target=4, max_num_seqs=8)
    assert policy.desired(1, reports(waiting=[13], running=[8])) == 4
    assert policy.desired(2, reports(waiting=[5, 4], running=[8, 8])) == 3
    assert policy.desired(2, reports(waiting=[4, 4], running=[8, 8])) == 2  # at the target: stay


def test_busy_replicas_with_no_queue_stay_and_idle_ones_go():
    policy = LoadSignalPolicy(WAITING, target=4, max_num_seqs=8)
    assert policy.desired(3, reports(waiting=[0, 0, 0], running=[8, 8, 8])) == 3
    assert policy.desired(3, reports(waiting=[0, 0, 0], running=[8, 3, 0])) == 2  # 11 fit in two replicas
    assert policy.desired(3, reports(waiting=[0, 0, 0], running=[0, 0, 0])) == 0  # Serve raises it to min_replicas


def test_kv_usage_scales_in_proportion():
    policy = LoadSignalPolicy(KV_USAGE, target=0.5, max_num_seqs=8)
    assert policy.desired(2, reports(kv_usage=[0.9, 0.7])) == 4
    assert policy.desired(4, reports(kv_usage=[0.1, 0.1, 0.2, 0.0])) == 1


def test_before_any_report_the_target_stands():
    policy = LoadSignalPolicy(WAITING, target=4, max_num_seqs=8)
    context = SimpleNamespace(aggregated_metrics={}, current_num_replicas=2, target_num_replicas=2)
    assert policy(context) == (2, {})


def test_the_settings_become_serves_config_with_the_policy_and_its_arguments():
    settings = AutoscalingSettings(min_replicas=1, max_replicas=3, target={"kv_usage": 0.7}, upscale_delay_s=2,
                                   look_back_s=3)
    config = serve_autoscaling_config(settings, max_num_seqs=16)
    assert (config["min_replicas"], config["max_replicas"], config["upscale_delay_s"]) == (1, 3, 2)
    assert config["look_back_period_s"] == 3
    assert config["policy"]["policy_kwargs"] == {"signal": "kv_usage", "target": 0.7, "max_num_seqs": 16}
    module, name = config["policy"]["policy_function"].split(":")
    assert getattr(__import__(module, fromlist=[name]), name) is LoadSignalPolicy


def test_a_ttft_over_the_target_asks_for_replicas_in_proportion_and_under_it_the_load_decides():
    policy = LoadSignalPolicy(TTFT, target=2.0, max_num_seqs=8)
    assert policy.desired(2, reports(ttft_p90_s=[5.0, 5.0], waiting=[0, 0], running=[8, 8])) == 5
    assert policy.desired(2, reports(ttft_p90_s=[1.0, 1.0], waiting=[3, 3], running=[8, 8])) == 2
    assert policy.desired(3, reports(ttft_p90_s=[0.5] * 3, waiting=[0] * 3, running=[4, 2, 0])) == 1


def test_scale_to_zero_waits_as_long_as_any_other_downscale():
    settings = AutoscalingSettings(min_replicas=0, max_replicas=2, target={"ttft_p90_s": 1}, downscale_delay_s=7)
    assert serve_autoscaling_config(settings, max_num_seqs=8)["downscale_to_zero_delay_s"] == 7


def test_the_recent_ttft_is_the_p90_of_the_window_with_waiting_requests_at_their_age():
    recent = RecentTTFT(window_s=10)
    for i in range(10):
        recent.add(0.1 * (i + 1), now=100.0)
    assert recent.p90([], now=101.0) == pytest.approx(0.9)
    assert recent.p90([95.0, 96.0], now=101.0) == pytest.approx(5.0)  # two requests waiting 6 s and 5 s
    assert recent.p90([], now=111.0) == 0.0  # the samples left the window
