"""Per-tenant quotas: token buckets for rates, plus the size and concurrency limits checked at the door.

Buckets may go negative. Completion tokens are charged as they stream, so a request that runs
past the remaining tokens/min budget still finishes; the debt delays the tenant's next admission
instead. Every refusal names the quota and, when waiting helps, says how long (Retry-After).
"""

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from kvloom.router.errors import APIError


class Quotas(BaseModel):
    """A tenant's limits; None means unlimited."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: float | None = Field(None, gt=0)
    tokens_per_minute: float | None = Field(None, gt=0, description="prompt + completion tokens")
    max_concurrent_requests: int | None = Field(None, ge=1, description="queued + running")
    max_tokens_per_request: int | None = Field(None, ge=2, description="prompt + max_tokens")
    max_queue_wait_s: float | None = Field(None, gt=0, description="longest wait in the router queue")


@dataclass
class TokenBucket:
    capacity: float
    rate: float  # refill per second
    level: float
    stamp: float  # when `level` was last brought up to date

    @classmethod
    def per_minute(cls, limit: float, now: float) -> "TokenBucket":
        return cls(capacity=limit, rate=limit / 60.0, level=limit, stamp=now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now)."""
        self.refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)

    def resize(self, limit: float, now: float) -> None:
        """Apply a new limit, keeping what has been used (and any debt)."""
        self.refill(now)
        used = self.capacity - self.level
        self.capacity, self.rate = limit, limit / 60.0
        self.level = limit - used


def _bucket(limit: float | None, current: TokenBucket | None, now: float) -> TokenBucket | None:
    if limit is None:
        return None
    if current is None:
        return TokenBucket.per_minute(limit, now)
    current.resize(limit, now)
    return current


def rate_limited(quota: str, message: str, wait_s: float) -> APIError:
    return APIError(429, message, None, quota,
                    headers={"Retry-After": str(max(1, math.ceil(wait_s))), "retry-after-ms": str(math.ceil(wait_s * 1000))})


@dataclass
class QuotaState:
    quotas: Quotas
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    concurrent: int = 0

    @classmethod
    def create(cls, quotas: Quotas, now: float) -> "QuotaState":
        state = cls(quotas)
        state.reconfigure(quotas, now)
        return state

    def reconfigure(self, quotas: Quotas, now: float) -> None:
        self.quotas = quotas
        self.requests = _bucket(quotas.requests_per_minute, self.requests, now)
        self.tokens = _bucket(quotas.tokens_per_minute, self.tokens, now)

    def admit(self, tenant: str, prompt_tokens: int, max_tokens: int | None, now: float) -> None:
        """Take one request slot and its prompt tokens, or raise the error naming the quota (nothing taken)."""
        q = self.quotas
        if q.max_tokens_per_request is not None and prompt_tokens + (max_tokens or 0) > q.max_tokens_per_request:
            raise APIError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds tenant "
                                f"'{tenant}' max_tokens_per_request of {q.max_tokens_per_request}",
                           "max_tokens", "max_tokens_per_request")
        if q.max_concurrent_requests is not None and self.concurrent >= q.max_concurrent_requests:
            raise rate_limited("max_concurrent_requests", f"tenant '{tenant}' already has {self.concurrent} requests in "
                               f"flight (max_concurrent_requests {q.max_concurrent_requests})", 1.0)
        if self.requests is not None and (wait := self.requests.wait_for(1, now)) > 0:
            raise rate_limited("requests_per_minute", f"tenant '{tenant}' is over its requests_per_minute quota "
                               f"of {q.requests_per_minute:g}; retry in {wait:.1f} s", wait)
        if self.tokens is not None:
            if prompt_tokens > self.tokens.capacity:
                raise APIError(400, f"prompt of {prompt_tokens} tokens exceeds tenant '{tenant}' tokens_per_minute "
                                    f"quota of {q.tokens_per_minute:g}; it can never be admitted", "prompt",
                               "tokens_per_minute")
            if (wait := self.tokens.wait_for(prompt_tokens, now)) > 0:
                raise rate_limited("tokens_per_minute", f"tenant '{tenant}' is over its tokens_per_minute quota of "
                                   f"{q.tokens_per_minute:g} (available {max(self.tokens.level, 0):.0f}, prompt "
                                   f"needs {prompt_tokens}); retry in {wait:.1f} s", wait)
            self.tokens.take(prompt_tokens)
        if self.requests is not None:
            self.requests.take(1)
        self.concurrent += 1

    def charge_completion(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.take(tokens)

    def finish(self, prompt_tokens: int, dispatched: bool) -> None:
        """The request is over; a prompt that never reached a replica is given back."""
        self.concurrent -= 1
        if self.tokens is not None and not dispatched:
            self.tokens.give_back(prompt_tokens)
