"""kvloom's autoscaling under Serve's own autoscaler: a backlog brings a second replica that serves, and once the
load is gone the deployment goes back to one. The tiny model with two slots a replica and no slack, so that
long requests queue in the router; logical CPUs, so the second replica has room (2-core hosts add no compute:
what is tested is the decision and the serving, not the speed-up)."""

import asyncio
import time

import httpx
import pytest
from ray import serve

from kvloom.cluster.config import ClusterConfig

pytestmark = pytest.mark.slow


def config(tiny_model_dir) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "served_model_name": "tiny",
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "kv_cache_memory_bytes": 16 << 20,
                   "max_model_len": 1024, "max_num_seqs": 2},
        "router": {"replica_slack": 0},
        "resources": {"num_cpus": 1, "torch_threads": 1},
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target": {"waiting_per_replica": 1},
                        "upscale_delay_s": 1, "downscale_delay_s": 2},
    })


def running_replicas() -> int:
    return serve.status().applications["kvloom"].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


async def replicas_reporting(router, count: int, timeout_s: float) -> list[dict] | None:
    """The router's replica stats once `count` replicas report, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while len(stats := await router.replica_stats.remote()) != count:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)
    return stats


def test_a_backlog_brings_a_second_replica_that_serves_and_idleness_takes_it_away(ray_serve, deploy_app,
                                                                                  tiny_model_dir):
    router = deploy_app(config(tiny_model_dir))
    assert running_replicas() == 1

    async def load_then_quiet() -> list[dict] | None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True}
        async with httpx.AsyncClient(base_url=ray_serve, timeout=300) as client:
            requests = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(16)]
            scaled = await replicas_reporting(router, 2, 90)
            if scaled is not None:  # the new replica takes requests from the backlog
                await asyncio.sleep(2)
                scaled = await router.replica_stats.remote()
            for request in requests:  # the clients walk away: the load is gone
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
        return scaled

    scaled = asyncio.run(load_then_quiet())
    assert scaled is not None, "no second replica within 90 s of a sustained backlog"
    assert len(scaled) == 2 and all(s["dispatched"] > 0 for s in scaled), scaled
    deadline = time.monotonic() + 60
    while running_replicas() != 1:
        assert time.monotonic() < deadline, "the idle second replica was not taken away within 60 s"
        time.sleep(0.5)
