"""Runs one request on the replicas: admission, dispatch, streaming, retry and accounting.

A replica that dies before a request streamed anything costs that request nothing: it is
retried at the head of the queue on another replica. One that dies mid-stream ends the request
with a clear error (a retry would repeat text the client already has).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray.exceptions

from kvloom.router.admission import AdmissionQueue, Ticket
from kvloom.router.errors import APIError
from kvloom.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


@dataclass
class Job:
    request_id: str
    payload: dict  # what EngineReplica.generate takes
    prompt_hashes: list[int]
    tenant: str = "default"
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)


class Dispatcher:
    def __init__(self, replicas_handle, admission: AdmissionQueue, metrics: RouterMetrics, max_retries: int = 2) -> None:
        self.handle = replicas_handle
        self.admission = admission
        self.metrics = metrics
        self.max_retries = max_retries

    async def run(self, job: Job) -> AsyncIterator[dict]:
        ticket = Ticket(job.request_id, job.prompt_hashes, job.tenant, job.priority)
        for attempt in range(self.max_retries + 1):
            replica = await self.admission.acquire(ticket, front=attempt > 0)
            if attempt == 0:
                self.metrics.queue_time.labels(job.tenant).observe(time.monotonic() - job.arrival)
            streamed = False
            finished = False
            response = self.handle.options(stream=True).generate.remote(job.payload, target_replica=replica.replica_id)
            try:
                async for chunk in self._observed(job, response):
                    streamed = streamed or bool(chunk.get("token_ids"))
                    finished = chunk.get("finish_reason") is not None or "error" in chunk
                    yield chunk
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.admission.table.drop(replica.replica_id)
                logger.warning("replica %s failed on %s: %r", replica.replica_id, job.request_id, exc)
                if streamed:
                    raise APIError(500, f"replica failed mid-stream after partial output: {type(exc).__name__}",
                                   code="replica_failed") from exc
            finally:
                if not finished:
                    response.cancel()
                self.admission.release(replica)
        raise APIError(500, f"request failed on {self.max_retries + 1} replicas", code="replica_failed")

    async def _observed(self, job: Job, response) -> AsyncIterator[dict]:
        """Account every streamed token to the tenant as it passes (aborted requests count too)."""
        first_token_at = None
        async for chunk in response:
            if "error" not in chunk and first_token_at is None and chunk.get("token_ids"):
                first_token_at = time.monotonic()
                self.metrics.ttft.labels(job.tenant).observe(first_token_at - job.arrival)
                self.metrics.prompt_tokens.labels(job.tenant).inc(chunk["prompt_tokens"])
            self.metrics.generation_tokens.labels(job.tenant).inc(len(chunk.get("token_ids") or ()))
            if chunk.get("finish_reason") is not None:
                now = time.monotonic()
                done = chunk["completion_tokens"]
                self.metrics.e2e.labels(job.tenant).observe(now - job.arrival)
                if first_token_at is not None and done > 1:
                    self.metrics.tpot.labels(job.tenant).observe((now - first_token_at) / (done - 1))
                self.metrics.requests.labels(job.tenant, chunk["finish_reason"], chunk["replica"]).inc()
            yield chunk
            await asyncio.sleep(0)
