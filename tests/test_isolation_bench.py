"""The isolation benchmark's statistics, workload and report on hand-made replies (the run itself is `python -m
kvloom.benchmarks.isolation`; it needs minutes, not a unit test)."""

import json
import random

import pytest

from kvloom.benchmarks import isolation
from kvloom.benchmarks.isolation import KEYS, Params, Reply, cross_tenant_figures, mann_whitney_p, routing_figures

PARAMS = Params()
TTFTS = [0.40 + 0.01 * (i % 7) for i in range(30)]


def test_mann_whitney_p_sees_a_shift_and_no_difference_in_a_reordering():
    assert mann_whitney_p(TTFTS, TTFTS[::-1]) > 0.9
    assert mann_whitney_p(TTFTS, [t + 0.05 for t in TTFTS]) < 0.001


def test_both_routing_runs_have_the_same_groups_of_prompts_sharing_a_prefix():
    """With tenants, A and B send the same prefix tokens under their own keys; on the open server the second copy's
    prefixes are other tokens: 2 x prefixes groups either way, in one order."""
    p = PARAMS.prefix_tokens

    def groups(requests):
        return {(key, tuple(prompt[:p])) for key, prompt in requests}

    tenants = isolation.routing_requests(PARAMS, True, random.Random(1))
    single = isolation.routing_requests(PARAMS, False, random.Random(1))
    assert len(groups(tenants)) == len(groups(single)) == 2 * PARAMS.prefixes
    assert len({prefix for _, prefix in groups(tenants)}) == PARAMS.prefixes
    assert {key for key, _ in tenants} == set(KEYS.values()) and {key for key, _ in single} == {None}
    assert len({tuple(prompt[p:]) for _, prompt in tenants}) == len(tenants)  # every question its own
    assert [len(prompt) for _, prompt in tenants] == [len(prompt) for _, prompt in single]


def test_extra_misses_count_prompts_computing_a_prefix_their_group_already_computed():
    """Each group computes its prefix once, whichever of its prompts runs first; every other miss is a loss."""
    params = Params(prefixes=1, questions=3)
    order = isolation.routing_order(params)
    hits = {"A": [0, 256, 256], "B": [256, 0, 0]}  # B's first-sent hit: another of its prompts ran first
    replies = [Reply(0.1, 280, hits[tenant].pop(0)) for tenant, _ in order]
    assert isolation.extra_misses(params, replies, 16) == 1


def results(cross_cached: list[int], cross_ttfts: list[float], hit_rates: tuple[float, float]) -> dict:
    full = (PARAMS.prompt_tokens - 1) // 16 * 16
    groups = {"cold": [Reply(t, PARAMS.prompt_tokens, 0) for t in TTFTS],
              "cross": [Reply(t, PARAMS.prompt_tokens, c) for t, c in zip(cross_ttfts, cross_cached)],
              "own": [Reply(t / 5, PARAMS.prompt_tokens, full) for t in TTFTS]}
    runs = [{"round": 0, "tenants": tenants, "requests": 64, "prompt_tokens": 1000, "cached_tokens": round(1000 * rate),
             "hit_rate": rate, "extra_misses": misses, "per_replica": [30, 34]}
            for tenants, rate, misses in zip((False, True), hit_rates, (0, 2))]
    return {"commit": "abc-dirty", "host": "test", "machine": "x86_64, test CPU, 2 cores", "wall_s": 1.0,
            "params": isolation.asdict(PARAMS), "settings": {
                "cross_tenant": {"replicas": 1, "torch_threads": 1, "max_num_seqs": 4, "kv_cache_mib": 256,
                                 "max_model_len": 1024, "block_size": 16},
                "routing": {"replicas": 2, "torch_threads": 1, "max_num_seqs": 8, "kv_cache_mib": 64,
                            "max_model_len": 512, "block_size": 16}},
            "cross_tenant": {**cross_tenant_figures(groups, 16), "load_avg": [1.0, 1.5]},
            "routing": routing_figures(runs, PARAMS, 16)}


def test_report_of_an_isolated_server(tmp_path):
    isolation.write_report(results([0] * 30, TTFTS[::-1], (0.75, 0.76)), tmp_path)
    report = (tmp_path / "isolation.md").read_text()
    assert "| another tenant's identical prompt: cached tokens | 0 in each of 30 | 0 to 0 | yes |" in report
    assert "| a tenant's own repeat: cached tokens | every full block (496) in each of 30 | 496 to 496 | yes |" \
        in report
    assert "| prefix-cache hit rate with tenants vs single-tenant | within 2 points | 76.0% vs 75.0% (+1.0 points) " \
           "| yes |" in report
    assert "**no**" not in report and "found nothing cached, in all 30 samples" in report
    assert "Single-tenant: 0 of the 56 prompts that could have found their group's prefix cached over 1 run computed " \
        "it again." in report and "Tenants: 2 of the 56 prompts" in report
    assert "at abc-dirty on x86_64, test CPU, 2 cores" in report
    saved = json.loads((tmp_path / "isolation.json").read_text())
    assert all(g["met"] for g in saved["goals"]) and saved["notes"]
    assert saved["routing"]["best_possible"] == pytest.approx(7 / 8 * 256 / 280)

    assert isolation.main(["--render", str(tmp_path / "isolation.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "isolation.md").read_text() == report


def test_the_reading_follows_the_figures_it_reads(tmp_path):
    """A cross-tenant hit is a breach, in the goal table and in the reading; so is a routing gap over 2 points."""
    leaky = results([0] * 29 + [496], [t * 0.7 for t in TTFTS], (0.75, 0.70))
    isolation.write_report(leaky, tmp_path)
    report = (tmp_path / "isolation.md").read_text()
    assert "| another tenant's identical prompt: cached tokens | 0 in each of 30 | 0 to 496 | **no** |" in report
    assert "**Isolation breach**" in report and "in 1 of 30 samples" in report
    assert "outside 0.9-1.1" in report and "TTFTs shorter, as the cached tokens above explain" in report
    assert "(-5.0 points, outside the 2-point goal)" in report
    assert "found nothing cached" not in report
