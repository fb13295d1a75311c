"""Multi-node placement: a 2-node Ray cluster on this machine, each node declaring two logical GPUs.

Two tensor-parallel replicas of 2 ranks of the tiny model (placement is what is tested), each rank asking for
`num_gpus: 1` in a STRICT_PACK placement group, land one per node with both ranks beside each other; with no CUDA
device they run on CPU (gloo) and say so.
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
    import json, socket, sys, time
    import ray
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
                   "tensor_parallel_size": 2},
        "num_replicas": 2, "resources": {"num_cpus": 0.5, "num_gpus": 1, "torch_threads": 1}})
    serve.run(build_app(config), name="kvloom", route_prefix="/")
    router = serve.get_deployment_handle(ROUTER_NAME, "kvloom")
    deadline = time.time() + 240
    while len(router.replica_stats.remote().result()) < 2 and time.time() < deadline:
        time.sleep(0.5)
    stats = router.replica_stats.remote().result()
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    print("RESULT " + json.dumps({"replicas": stats, "nodes": nodes}))
    serve.shutdown(); ray.shutdown(); cluster.shutdown()
    """
)


def test_tensor_parallel_gpu_replicas_pack_one_per_node_and_fall_back_to_cpu(tiny_model_dir):
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
