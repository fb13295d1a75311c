"""Tenants: who is asking (API key → tenant), what they may ask for, and what they have used.

Keys live in memory only as SHA-256 digests, and a lookup compares the presented key's digest
with every stored one using `hmac.compare_digest`, so neither the plaintext nor timing gives a
key away. With no tenants configured every request belongs to one anonymous tenant, so the local
quickstart needs no key.
"""

import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvloom.router.errors import APIError
from kvloom.router.quotas import Quotas, QuotaState

ANONYMOUS = "default"
DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def key_digest(key: str) -> str:
    """The stored form of a key: `sha256:<hex>`; a key already in that form is kept as is."""
    if _DIGEST.match(key):
        return key
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="also the `tenant` metric label")
    api_keys: list[str] = Field(min_length=1, description="plaintext keys or their 'sha256:<hex>' digests")
    weight: float = Field(1.0, gt=0, description="fair share relative to other tenants")
    priority: int = Field(0, description="default priority class; lower runs first")
    best_priority: int | None = Field(None, description="lowest priority value it may ask for; default: `priority`")
    quotas: Quotas = Field(default_factory=Quotas)
    lora_adapters: list[str] | None = Field(None, description="the LoRA adapters it may use (none listed: every one)")
    prefix_cache_group: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description=(
        "tenants naming one group share their prefix cache; by default a tenant's cached prefixes are its own"))

    @field_validator("api_keys")
    @classmethod
    def _non_empty_keys(cls, keys: list[str]) -> list[str]:
        for i, key in enumerate(keys):
            if not key.strip():
                raise ValueError(f"api_keys[{i}] is empty")
        return keys

    @model_validator(mode="after")
    def _best_priority(self) -> "TenantConfig":
        if self.best_priority is None:
            self.best_priority = self.priority
        if self.best_priority > self.priority:
            raise ValueError(f"best_priority ({self.best_priority}) must not be worse (higher) than priority ({self.priority})")
        return self

    def hashed(self) -> "TenantConfig":
        """The same tenant with its keys as digests: what may travel to other processes."""
        return self.model_copy(update={"api_keys": [key_digest(k) for k in self.api_keys]})


def check_unique(tenants: Iterable[TenantConfig], admin_keys: Iterable[str]) -> None:
    """Names and keys must be unique across tenants and admin keys; the error names the offender."""
    owners: dict[str, str] = {key_digest(k): "admin_keys" for k in admin_keys}
    names: set[str] = set()
    for i, tenant in enumerate(tenants):
        if tenant.name in names:
            raise ValueError(f"tenants[{i}].name: duplicate tenant name '{tenant.name}'")
        names.add(tenant.name)
        for j, key in enumerate(tenant.api_keys):
            digest = key_digest(key)
            if digest in owners:
                raise ValueError(f"tenants[{i}].api_keys[{j}]: key already used by {owners[digest]}")
            owners[digest] = f"tenant '{tenant.name}'"


@dataclass
class Usage:
    """Exact per-tenant accounting of what replicas actually processed and what was refused."""

    requests: int = 0  # finished on a replica (a prompt's n choices count once)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # by reason (the error code)
    lora: dict[str, "Usage"] = field(default_factory=dict)  # the same counts for each LoRA adapter used

    def add(self, adapter: str = "", requests: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count processed work, under `adapter` too where it ran with one."""
        for usage in (self, self.lora.setdefault(adapter, Usage())) if adapter else (self,):
            usage.requests += requests
            usage.prompt_tokens += prompt_tokens
            usage.completion_tokens += completion_tokens

    def as_dict(self) -> dict:
        counts = {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                  "completion_tokens": self.completion_tokens,
                  "total_tokens": self.prompt_tokens + self.completion_tokens}
        if not self.lora:
            return {**counts, "rejected": dict(self.rejected)}
        return {**counts, "rejected": dict(self.rejected),
                "lora": {name: {k: v for k, v in usage.as_dict().items() if k != "rejected"}
                         for name, usage in sorted(self.lora.items())}}


@dataclass
class Tenant:
    config: TenantConfig
    quota: QuotaState
    usage: Usage = field(default_factory=Usage)
    is_anonymous: bool = False  # an open server's one tenant: any priority, no cache namespace of its own

    @classmethod
    def anonymous(cls, now: float | None = None) -> "Tenant":
        config = TenantConfig.model_construct(name=ANONYMOUS, api_keys=[], weight=1.0, priority=0,
                                              best_priority=0, quotas=Quotas())
        return cls(config, QuotaState.create(config.quotas, time.monotonic() if now is None else now),
                   is_anonymous=True)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def weight(self) -> float:
        return self.config.weight

    @property
    def cache_namespace(self) -> str | None:
        """Whose prefix cache its requests read (engine/cache_namespace.py): its group's, else its own; the
        anonymous tenant of an open server has none (everyone is that tenant)."""
        if self.is_anonymous:
            return None
        group = self.config.prefix_cache_group
        return f"group:{group}" if group is not None else f"tenant:{self.name}"

    def effective_priority(self, requested: int | None) -> int:
        """The request's priority class: its own if the tenant may ask for it, else the tenant's default."""
        if requested is None:
            return self.config.priority
        if not self.is_anonymous and requested < self.config.best_priority:
            raise APIError(403, f"tenant '{self.name}' may not ask for priority {requested}; its best is "
                                f"{self.config.best_priority} (lower runs first)", "priority", "priority_not_allowed")
        return requested

    def reject(self, reason: str | None) -> None:
        reason = reason or "error"
        self.usage.rejected[reason] = self.usage.rejected.get(reason, 0) + 1


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@dataclass
class KeyStore:
    digests: list[tuple[bytes, str]]  # (sha256 digest, owner)

    @classmethod
    def build(cls, keys: Iterable[tuple[str, str]]) -> "KeyStore":
        return cls([(bytes.fromhex(key_digest(key)[len(DIGEST_PREFIX):]), owner) for key, owner in keys])

    def owner(self, key: str) -> str | None:
        """Compare against every digest (no early exit), each in constant time."""
        presented = hashlib.sha256(key.encode()).digest()
        found = None
        for digest, owner in self.digests:
            if hmac.compare_digest(digest, presented):
                found = owner
        return found


class TenantRegistry:
    """The configured tenants, reconfigurable in place: usage and quota state survive a reload."""

    def __init__(self, tenants: list[TenantConfig] = (), admin_keys: list[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tenants: dict[str, Tenant] = {}
        self.ledger: dict[str, Tenant] = {}  # every tenant ever served, for usage; outlives reloads
        self.anonymous = Tenant.anonymous(clock())
        self.ledger[ANONYMOUS] = self.anonymous
        self.reconfigure(tenants, admin_keys)

    def reconfigure(self, tenants: list[TenantConfig], admin_keys: list[str]) -> None:
        check_unique(tenants, admin_keys)
        now = self.clock()
        current = {}
        for config in (t.hashed() for t in tenants):  # no plaintext key outlives this call
            tenant = self.ledger.get(config.name)
            if tenant is None:
                tenant = Tenant(config, QuotaState.create(config.quotas, now))
            else:
                tenant.config = config
                tenant.quota.reconfigure(config.quotas, now)
            current[config.name] = self.ledger[config.name] = tenant
        self.tenants = current
        self.keys = KeyStore.build((key, t.name) for t in tenants for key in t.api_keys)
        self.admins = KeyStore.build((key, "admin") for key in admin_keys)

    @property
    def open(self) -> bool:
        """No tenants configured: everyone is the anonymous tenant."""
        return not self.tenants

    def authenticate(self, authorization: str | None) -> Tenant:
        if self.open:
            return self.anonymous
        key = _bearer(authorization)
        if key is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", None, "missing_api_key")
        owner = self.keys.owner(key)
        if owner is None:
            raise APIError(401, "invalid API key", None, "invalid_api_key")
        return self.tenants[owner]

    def authenticate_admin(self, authorization: str | None) -> None:
        """Admin endpoints need an admin key, except on an open server with no admin keys at all."""
        if self.open and not self.admins.digests:
            return
        key = _bearer(authorization)
        if key is None or self.admins.owner(key) is None:
            raise APIError(401, "this endpoint needs an admin API key (admin_keys)", None, "invalid_admin_key")

    def usage(self) -> dict[str, dict]:
        """Current tenants (the anonymous one when open), and past ones that used anything."""
        current = self.tenants or {ANONYMOUS: self.anonymous}
        shown = {name: t for name, t in self.ledger.items() if name in current or t.usage != Usage()}
        return {name: tenant.usage.as_dict() for name, tenant in sorted(shown.items())}
