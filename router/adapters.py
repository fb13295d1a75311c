"""The LoRA adapters a cluster serves, as its router knows them: which adapter a request's `model` names, whether
its tenant may use it, load and unload at run time, and each adapter's block-hash root for prefix affinity.

A request names an adapter by its name or as `base:adapter`; the replica it reaches gets the adapter's directory
with it, so any replica (one started after a run-time load too) can read it.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import ray

from kvloom.engine.config import LoRAConfig
from kvloom.engine.lora.identity import WEIGHTS_FILE, LoRARequest, adapter_under, adapters_under, cache_root_of
from kvloom.router.errors import APIError
from kvloom.router.tenants import Tenant

@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    root: int  # its prompts' block-hash root (engine/lora/identity.py)

    @property
    def request(self) -> LoRARequest:
        return LoRARequest(name=self.name, path=self.path)


class AdapterCatalog:
    def __init__(self, config: LoRAConfig | None, base_names: tuple[str, ...], ledger=None) -> None:
        """`ledger`: the deployment's AdapterLedger (router/adapter_ledger.py), where run-time loads are recorded and
        a restarted router finds them."""
        self.config = config
        self.base_names = base_names
        self.ledger = ledger
        recorded = ray.get(ledger.recorded.remote()) if ledger is not None else None
        # from the config, and loaded since (by this router or the one before it in this deployment)
        self.paths: dict[str, str] = recorded if recorded is not None else dict(config.adapters) if config else {}
        self._roots: dict[tuple[str, str, int], int] = {}  # (name, path, the weights' mtime) -> root

    def served(self) -> dict[str, str]:
        """Every adapter a request may name -> its directory."""
        found = adapters_under(self.config.dynamic_loading_path) if self.config else {}
        return {**{name: str(path) for name, path in found.items()}, **self.paths}

    def resolve(self, model: str, tenant: Tenant | None = None) -> ServedAdapter | None:
        """The adapter `model` names (None: the base model); 404 if none has that name, 403 if `tenant` may not
        use it."""
        if model in self.base_names:
            return None
        base, colon, name = model.partition(":")
        name = name if colon and base in self.base_names else model
        path = self.paths.get(name) or (adapter_under(self.config.dynamic_loading_path, name) if self.config else None)
        if path is None:
            raise APIError(404, f"model '{model}' does not exist; this server serves '{self.base_names[0]}'"
                                f"{' and its LoRA adapters' if self.config else ''}", "model", "model_not_found")
        allowed = tenant.config.lora_adapters if tenant is not None else None
        if allowed is not None and name not in allowed:
            raise APIError(403, f"tenant '{tenant.name}' may not use the LoRA adapter '{name}'", "model",
                           "adapter_not_allowed")
        return ServedAdapter(name, str(path), self._root(name, str(path)))

    async def register(self, name: str, path: str) -> None:
        self.paths[name] = path
        await self._record()

    async def unregister(self, name: str) -> None:
        if self.paths.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter named '{name}' was loaded", "lora_name", "adapter_not_found")
        await self._record()

    async def _record(self) -> None:
        """Recorded before the client hears of it: a router that crashes after answering loses nothing."""
        if self.ledger is not None:
            await self.ledger.record.remote(self.paths)

    def _root(self, name: str, path: str) -> int:
        """Hashing the weights file each request would cost milliseconds: kept while the file is unchanged."""
        try:
            key = (name, path, os.stat(Path(path) / WEIGHTS_FILE).st_mtime_ns)
            if key not in self._roots:
                self._roots[key] = cache_root_of(name, path)
        except OSError as exc:
            raise APIError(404, f"the LoRA adapter '{name}' cannot be read: {exc}", "model",
                           "model_not_found") from None
        return self._roots[key]
