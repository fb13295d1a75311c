"""Multi-node placement: a 2-node Ray cluster on this machine, each node declaring two logical GPUs.

Tensor-parallel replicas of 2 ranks of the tiny model (placement is what is tested), each rank asking for
`num_gpus: 1` in a STRICT_PACK placement group, autoscaled from one to two: a backlog brings the second replica,
which lands on the node with room, both ranks beside each other; with no CUDA device they run on CPU (gloo) and
say so. The router's scaling log says when it joined and on what signal (`kvloom status` shows it).
Runs in a fresh interpreter because it needs its own Ray cluster (the session one is single-node).
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, socket, sys, threading, time
    import httpx, ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from kvloom.cluster.app import ROUTER_NAME, build_app
    from kvloom.cluster.config import ClusterConfig

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ClusterConfig.model_validate({
        "engine": {"model": sys.argv[1], "kv_cache_memory_bytes": 4194304, "max_model_len": 512,
                   "tensor_parallel_size": 2, "max_num_seqs": 2},
        "router": {"replica_slack": 0},
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target": {"waiting_per_replica": 1},
                        "upscale_delay_s": 1, "look_back_s": 2, "downscale_delay_s": 600},
        "resources": {"num_cpus": 0.5, "num_gpus": 1, "torch_threads": 1}})
    serve.run(build_app(config), name="kvloom", route_prefix="/")
    router = serve.get_deployment_handle(ROUTER_NAME, "kvloom")

    def replicas(count):
        deadline = time.time() + 240
        while len(router.replica_stats.remote().result()) < count and time.time() < deadline:
            time.sleep(0.5)
    replicas(1)
    body = {"model": sys.argv[1], "prompt": "w5 w6", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    for _ in range(24):  # two run, 22 wait in the router: a backlog that outlasts the second replica's start
        threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                                   timeout=600), daemon=True).start()
    replicas(2)
    stats = router.replica_stats.remote().result()
    events = router.scaling_events.remote().result()
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    print("RESULT " + json.dumps({"replicas": stats, "nodes": nodes, "events": events}))
    # no serve.shutdown(): it would wait out the replicas' graceful period (the backlog still runs on them);
    # the cluster's processes all end with it
    ray.shutdown(); cluster.shutdown()
    """
)


def test_a_backlog_brings_a_tensor_parallel_replica_to_the_node_with_room_and_the_log_says_why(tiny_model_dir):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))
    replicas = result["replicas"]
    assert len(replicas) == 2
    assert {r["node_id"] for r in replicas} == set(result["nodes"])  # one replica on each node
    assert all(r["device"] == "cpu" for r in replicas)  # logical GPUs only: the engine ran on CPU
    for r in replicas:  # STRICT_PACK: both ranks on the replica's own node, each with a GPU of its own
        assert [rank["rank"] for rank in r["ranks"]] == [0, 1]
        assert all(rank["placement"].startswith(f"node {r['node_id'][:12]}") for rank in r["ranks"]), r["ranks"]
        assert len({rank["placement"] for rank in r["ranks"]}) == 2
    joined = [e for e in result["events"] if e["joined"]]
    assert [e["replicas"] for e in joined] == [1, 2], result["events"]
    assert joined[1]["waiting_per_replica"] > 1 and joined[1]["running"] == 2  # the backlog it joined on
