"""Runs one request on the replicas: admission, dispatch, streaming, retry and accounting.

A replica that dies costs its requests nothing. One that streamed nothing yet is retried at the
head of the queue on another replica. One that streamed part of its output continues on another
replica: the prompt plus the tokens the client has are recomputed there (a prefix-cache hit where that
replica holds them) and the stream goes on from the next token, with no repeated text (greedy output
is what an uninterrupted run gives; a seeded sample draws what it would have). Retries are bounded by
`max_retries` and each waits at most `retry_wait_s` for a replica. Streams that cannot be continued
(disaggregated ones, once handed off) end with a clear error instead.

The tenant's quotas are checked before the request queues, and every token is accounted to the
tenant exactly once as it streams past: usage, the tokens/min bucket, the VTC counter, metrics.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray.exceptions

from kvloom.engine.errors import EngineDeadError
from kvloom.replicas.messages import Chunk, Continuation, SubmitRequest
from kvloom.router.admission import AdmissionQueue, Ticket
from kvloom.router.channels import ReplicaGone, ReplicaLeft
from kvloom.router.errors import APIError
from kvloom.router.metrics import RouterMetrics
from kvloom.router.recent_ttft import RecentTTFT
from kvloom.router.tenants import Tenant

logger = logging.getLogger(__name__)


def replica_died(exc: Exception) -> bool:
    """The replica is gone (its actor died or left), or its engine died and Serve is replacing it."""
    return (isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaGone))
            or isinstance(exc, EngineDeadError) or isinstance(getattr(exc, "cause", None), EngineDeadError))


@dataclass
class Delivered:
    """What the client has of a request so far: a continuation on another replica starts after it."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    first_token_at: float | None = None


@dataclass
class Job:
    message: SubmitRequest  # what the replica gets (its engine priority and continuation are set per attempt)
    prompt_hashes: list[int]
    tenant: Tenant = field(default_factory=Tenant.anonymous)
    priority: int = 0  # effective class (the tenant may or may not ask for better)
    prompt_tokens: int = 0
    max_tokens: int | None = None  # None: up to max_model_len
    estimated_tokens: int = 0  # prompt + max_tokens, for sjf
    arrival: float = field(default_factory=time.monotonic)

    @property
    def shares_prompt(self) -> bool:
        """A prompt's later choice (n > 1): it forks the first choice's prompt KV and rides on that choice's
        admission, so the prompt counts once, as OpenAI and vLLM count it, in usage, quotas and fair share."""
        return self.message.fork_of is not None

    @property
    def request_id(self) -> str:
        return self.message.request_id


class Dispatcher:
    def __init__(self, streams, admission: AdmissionQueue, metrics: RouterMetrics, max_retries: int = 2,
                 retry_wait_s: float = 60.0) -> None:
        self.streams = streams  # ReplicaChannels or DisaggStreams: `open(message, replica_id)`, `resumable`
        self.admission = admission
        self.metrics = metrics
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self.active = 0  # requests between admission and their last chunk (what a drain waits for)
        self.recent_ttft = RecentTTFT()
        self.awaiting_first_token: dict[str, float] = {}  # request -> arrival

    async def run(self, job: Job) -> AsyncIterator[Chunk]:
        self.active += 1
        self.awaiting_first_token[job.request_id] = job.arrival
        try:
            async for chunk in self._run(job):
                yield chunk
        finally:
            self.active -= 1
            self.awaiting_first_token.pop(job.request_id, None)

    def ttft_p90_s(self) -> float:
        """The p90 time to first token of the last seconds, requests still waiting counted at their age."""
        return self.recent_ttft.p90(list(self.awaiting_first_token.values()))

    async def _run(self, job: Job) -> AsyncIterator[Chunk]:
        tenant, admitted = job.tenant, not job.shares_prompt
        try:
            if admitted:
                tenant.quota.admit(tenant.name, job.prompt_tokens, job.max_tokens, job.arrival)
        except APIError as exc:
            self._rejected(tenant, exc)
            raise
        ticket = Ticket(job.request_id, job.prompt_hashes, tenant.name, job.priority, tenant.weight,
                        job.prompt_tokens if admitted else 0, job.estimated_tokens, job.arrival,
                        tenant.config.quotas.max_queue_wait_s,
                        adapter=job.message.lora.name if job.message.lora is not None else None)
        try:
            async for chunk in self._attempts(job, ticket):
                yield chunk
        except APIError as exc:
            self._rejected(tenant, exc)
            raise
        finally:
            if admitted:
                tenant.quota.finish(job.prompt_tokens, ticket.dispatched)

    def _rejected(self, tenant: Tenant, exc: APIError) -> None:
        tenant.reject(exc.code)
        self.metrics.rejected.labels(tenant.name, exc.code or "error").inc()

    async def _attempts(self, job: Job, ticket: Ticket) -> AsyncIterator[Chunk]:
        delivered = Delivered()
        for attempt in range(self.max_retries + 1):
            replica = await self._acquire(job, ticket, attempt)
            finished = False
            if attempt > 0:
                self.metrics.moved.labels(job.tenant.name, "continued" if delivered.token_ids else "retried").inc()
            continuation = Continuation(output_token_ids=list(delivered.token_ids), emitted_chars=delivered.chars) \
                if delivered.token_ids else None
            message = job.message.model_copy(update={"engine_priority": ticket.engine_priority,
                                                     "yields_prefill": ticket.yields_prefill,
                                                     "continuation": continuation})
            response = self.streams.open(message, replica.replica_id)
            try:
                async for chunk in self._observed(job, ticket, response, delivered):
                    finished = chunk.finished
                    yield chunk
                return
            except (ray.exceptions.RayError, ReplicaGone) as exc:
                if not replica_died(exc):  # the replica raised (e.g. a KV hand-off timed out)
                    logger.warning("replica %s errored on %s: %r", replica.replica_id, job.request_id, exc)
                    raise APIError(500, f"replica failed: {type(exc).__name__}", code="replica_failed") from exc
                self.admission.table.drop(replica.replica_id)
                logger.log(logging.INFO if isinstance(exc, ReplicaLeft) else logging.WARNING,
                           "request %s leaves replica %s after %d token(s): %r", job.request_id, replica.replica_id,
                           len(delivered.token_ids), exc)
                if delivered.token_ids and not self.streams.resumable:
                    raise APIError(500, f"replica failed mid-stream after partial output: {type(exc).__name__}",
                                   code="replica_failed") from exc
            finally:
                if not finished:
                    response.cancel()
                self.admission.release(replica, ticket)
        raise APIError(500, f"replica failed on each of {self.max_retries + 1} attempts", code="replica_failed")

    async def _acquire(self, job: Job, ticket: Ticket, attempt: int):
        """A replica to run on; a retry goes to the head of the queue and waits at most `retry_wait_s`."""
        if attempt == 0:
            replica = await self.admission.acquire(ticket)
            self.metrics.queue_time.labels(job.tenant.name).observe(time.monotonic() - job.arrival)
            return replica
        try:
            return await asyncio.wait_for(self.admission.acquire(ticket, front=True), self.retry_wait_s)
        except TimeoutError:
            raise APIError(503, f"replica failed and no other was ready within {self.retry_wait_s:g} s",
                           code="replica_failed") from None

    async def _observed(self, job: Job, ticket: Ticket, response, delivered: Delivered) -> AsyncIterator[Chunk]:
        """Account every streamed token to the tenant as it passes, once however many replicas the stream
        took (aborted requests count too), and note what the client has in `delivered`. A prompt's later
        choices count their generated tokens only."""
        tenant, label, own_prompt = job.tenant, job.tenant.name, not job.shares_prompt
        lora = job.message.lora.name if job.message.lora is not None else ""
        async for chunk in response:
            generated = len(chunk.token_ids)
            if chunk.error is None and delivered.first_token_at is None and generated:
                delivered.first_token_at = time.monotonic()
                self.metrics.ttft.labels(label).observe(delivered.first_token_at - job.arrival)
                self.recent_ttft.add(delivered.first_token_at - job.arrival, delivered.first_token_at)
                self.awaiting_first_token.pop(job.request_id, None)
                if own_prompt:
                    self.metrics.prompt_tokens.labels(label, lora).inc(chunk.prompt_tokens)
                    tenant.usage.add(lora, prompt_tokens=chunk.prompt_tokens)
            if chunk.error is None:
                delivered.token_ids += chunk.token_ids
                delivered.chars += len(chunk.text)
            if generated:
                self.metrics.generation_tokens.labels(label, lora).inc(generated)
                tenant.usage.add(lora, completion_tokens=generated)
                tenant.quota.charge_completion(generated)
                self.admission.charge(ticket, generated)
            if chunk.finish_reason is not None:
                now = time.monotonic()
                done = chunk.completion_tokens
                if own_prompt:
                    tenant.usage.add(lora, requests=1)
                self.metrics.e2e.labels(label).observe(now - job.arrival)
                if delivered.first_token_at is not None and done > 1:
                    self.metrics.tpot.labels(label).observe((now - delivered.first_token_at) / (done - 1))
                self.metrics.requests.labels(label, chunk.finish_reason, chunk.replica, lora).inc()
            yield chunk
            await asyncio.sleep(0)
