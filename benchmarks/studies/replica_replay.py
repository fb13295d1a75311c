"""A workload straight into a running `kvloom serve`'s engine replica: no router, no HTTP, no SSE client.

`kvloom serve` falls short of its offline engine for two reasons that one served run cannot tell apart: the
engine runs as a Serve replica among Ray's processes, and an HTTP path stands in front of it (the router, one
SSE event a token, the client). This driver measures the first alone. It joins the cluster that `kvloom serve`
started and makes the calls the router makes, through a Serve handle: `submit` per request at its arrival
offset, and every request's chunks back over one `outputs` channel, a step's worth per message (see
router/channels.py). The records are the HTTP replay's, timed where the chunks arrive.

    python -m kvloom.benchmarks.studies.replica_replay --address GCS_ADDRESS --workload W.jsonl --out OUT.json
"""

import argparse
import asyncio
import json
import re
import time
import uuid
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from kvloom.benchmarks.metrics import RequestRecord
from kvloom.benchmarks.serving_cpu import own_cpu_seconds
from kvloom.benchmarks.workloads import Workload, WorkloadRequest
from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.messages import SubmitRequest

ADDRESS_LINE = re.compile(r"kvloom status --address (\S+)")  # what `kvloom serve` prints once its replicas report


def cluster_address(serve_log: str) -> str | None:
    """The Ray cluster's address from `kvloom serve`'s output, once it is there."""
    found = ADDRESS_LINE.search(serve_log)
    return found.group(1) if found else None


def submit_message(request: WorkloadRequest) -> SubmitRequest:
    """What the router would submit for the HTTP replay's request (greedy, `ignore_eos`, text detokenized)."""
    return SubmitRequest(request_id=request.request_id, prompt_token_ids=list(request.prompt),
                         sampling=SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True))


async def replay_replica(handle, workload: Workload, timeout_s: float = 900) -> tuple[list[RequestRecord], float]:
    """Every request through the replica's own calls; the records and the wall time from the first arrival to
    the last finish."""
    channel = uuid.uuid4().hex
    outputs = handle.options(stream=True).outputs.remote(channel)
    replica = (await outputs.__anext__()).replica  # the channel's first item names its replica
    arrived: dict[str, float] = {}
    finished: dict[str, float] = {}
    tokens: dict[str, list[int]] = defaultdict(list)
    times: dict[str, list[float]] = defaultdict(list)
    start = time.monotonic()

    async def submit(request: WorkloadRequest) -> None:
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
        arrived[request.request_id] = time.monotonic()
        reply = await handle.submit.remote(submit_message(request), channel, target_replica=replica)
        if reply.error is not None:
            raise RuntimeError(f"{request.request_id}: {reply.error.message}")

    async def read() -> None:
        async for step in outputs:
            now = time.monotonic()
            for chunk in step.chunks:
                if chunk.error is not None:
                    raise RuntimeError(f"{chunk.request_id}: {chunk.error.message}")
                request_id = chunk.request_id
                tokens[request_id] += chunk.token_ids
                times[request_id] += [now] * len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    finished[request_id] = now
            if len(finished) == len(workload.requests):
                return

    try:
        await asyncio.wait_for(asyncio.gather(read(), *map(submit, workload.requests)), timeout_s)
    finally:
        outputs.cancel()  # ends the replica's channel: an open one holds its stop for the graceful period
    records = [RequestRecord(r.request_id, len(r.prompt), tokens[r.request_id], arrived[r.request_id],
                             times[r.request_id][0] if times[r.request_id] else finished[r.request_id],
                             finished[r.request_id], token_times=times[r.request_id]) for r in workload.requests]
    return records, max(finished.values()) - min(arrived.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True, help="the Ray cluster `kvloom serve` started (its GCS address)")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--app", default="kvloom", help="the Serve application's name (the config's `name`)")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()

    import ray
    from ray import serve

    from kvloom.cluster.app import REPLICA_NAME
    from kvloom.cluster.ray_auth import use_token_for_address

    use_token_for_address(args.address)
    ray.init(address=args.address, namespace="serve", log_to_driver=False, logging_level="ERROR")
    handle = serve.get_deployment_handle(REPLICA_NAME, args.app)
    cpu = own_cpu_seconds()
    records, wall = asyncio.run(replay_replica(handle, Workload.load(args.workload), args.timeout_s))
    args.out.write_text(json.dumps({"wall_s": wall, "driver_cpu_s": own_cpu_seconds() - cpu,
                                    "records": [asdict(r) for r in records]}))


if __name__ == "__main__":
    main()
