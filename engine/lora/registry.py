"""The adapters an engine may serve, by name, and their weights in host memory (least recently used go first).

A request carries an `AdapterRef`, not the weights: an adapter idle long enough to be evicted is read again from
its directory when a request needs it, and one unloaded by name while requests use it still serves them.
"""

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from kvloom.engine.config import LoRAConfig
from kvloom.engine.errors import AdapterNotFoundError, ConfigError, InvalidRequestError
from kvloom.engine.lora.adapter import AdapterRef, LoRAAdapter, inspect_adapter, load_adapter
from kvloom.engine.lora.identity import adapter_under, adapters_under
from kvloom.engine.model.model_config import ModelConfig


class LoRARegistry:
    """Thread-safe: requests are built (and adapters resolved) off the engine's thread."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, dtype: torch.dtype,
                 for_cpu_op: bool = False) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.for_cpu_op = for_cpu_op  # adapters laid out for the C++ op as they are read (engine/lora/adapter.py)
        self.paths: dict[str, Path] = {}  # registered names (config and load); the dynamic directory adds more
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # by name, least recently used first
        self.num_loads = 0  # reads from disk: first loads and reloads after eviction
        self._lock = threading.Lock()
        for name, path in config.adapters.items():  # checked now, read when a request needs them
            try:
                inspect_adapter(Path(path), model_config, config.max_lora_rank)
            except InvalidRequestError as exc:
                raise ConfigError(f"lora.adapters.{name}", str(exc)) from None
            self.paths[name] = Path(path)

    def names(self) -> list[str]:
        """Every adapter a request may name: registered, and under the dynamic loading path."""
        return sorted(set(self.paths) | set(adapters_under(self.config.dynamic_loading_path)))

    def loaded(self) -> list[str]:
        """The adapters in host memory now, most recently used last (the router sends their requests here)."""
        with self._lock:
            return list(self.host)

    def load(self, name: str, path: str | Path) -> AdapterRef:
        """Register an adapter under `name` (its weights read and checked now)."""
        with self._lock:
            if name in self.paths:
                raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded")
            adapter = self._read(name, Path(path))
            self.paths[name] = adapter.path
            return AdapterRef(name, adapter.path, adapter.cache_root)

    def unload(self, name: str) -> None:
        """Forget `name`: new requests for it are refused; those already holding it finish."""
        with self._lock:
            if self.paths.pop(name, None) is None:
                raise AdapterNotFoundError(name)
            self.host.pop(name, None)

    def resolve(self, name: str, path: str | None = None) -> AdapterRef:
        """The adapter a request names: in `path` where given, else registered, else a directory of that name under
        the dynamic loading path."""
        with self._lock:
            path = Path(path) if path is not None else self.paths.get(name) or self._dynamic_path(name)
            adapter = self.host.get(name)
            if adapter is None or adapter.path != path:
                adapter = self._read(name, path)
            self.host.move_to_end(name)
            return AdapterRef(name, adapter.path, adapter.cache_root)

    def weights(self, ref: AdapterRef) -> LoRAAdapter:
        """The adapter's weights in host memory, read again if they were evicted (CUDA copies them into slots:
        engine/lora/adapter_slots.py)."""
        with self._lock:
            adapter = self.host.get(ref.name)
            if adapter is None or adapter.cache_root != ref.cache_root:
                adapter = self._read(ref.name, ref.path)
            self.host.move_to_end(ref.name)
            return adapter

    def _dynamic_path(self, name: str) -> Path:
        if (path := adapter_under(self.config.dynamic_loading_path, name)) is None:
            raise AdapterNotFoundError(name)
        return path

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        """Load from disk into the host LRU (the lock held)."""
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.for_cpu_op)
        self.num_loads += 1
        self.host[name] = adapter
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter
