"""Replay a workload against a running kvloom server over real HTTP (streaming), timing every token.

Requests are sent at their arrival offsets; each streams (`stream: true`, `ignore_eos`) so the
client sees its first token and each later one as they arrive. Loopback only, bounded: the
replay ends when every request has finished or `timeout_s` has passed.
"""

import asyncio
import json
import time

import httpx

from kvloom.benchmarks.metrics import RequestRecord
from kvloom.benchmarks.workloads import Workload, WorkloadRequest


async def _one(client: httpx.AsyncClient, base: str, model: str, request: WorkloadRequest, start: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
    arrival = time.monotonic()
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{request.request_id}: {chunk['error']['message']}")
                if chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]:
                    times.append(time.monotonic())
    finished = time.monotonic()
    # SSE chunks carry text, not ids: one chunk may hold several tokens; count what was asked for
    return RequestRecord(request.request_id, len(request.prompt), [0] * request.max_tokens, arrival,
                         times[0] if times else finished, finished, token_times=times)


async def replay_http(base: str, workload: Workload, model: str = "smollm2", timeout_s: float = 900) -> tuple[list[RequestRecord], float]:
    """Returns the records and the wall time from the first arrival to the last finish."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.monotonic()
        records = await asyncio.wait_for(
            asyncio.gather(*(_one(client, base, model, r, start) for r in workload.requests)), timeout_s)
    return list(records), max(r.finished for r in records) - min(r.arrival for r in records)
