"""A safetensors checkpoint's tensors by name, memory-mapped (one file or an indexed set of shards).

A tensor stored in the dtype it is asked for is a view of the mapped file: no copy, and pages are read
only when touched (the embedding table's rows as tokens use them).
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvloom.engine.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    def __init__(self, model_dir: Path, files: dict[str, Path], dtype: torch.dtype, device: torch.device) -> None:
        """`files`: tensor name -> the file holding it; tensors are read as `dtype` on `device`."""
        self.model_dir = model_dir
        self.files = files
        self.dtype = dtype
        self.device = device
        self._open: dict[Path, object] = {}

    @classmethod
    def open(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> "Checkpoint | None":
        """The directory's safetensors weights, or None if it has none (say, only pytorch_model.bin)."""
        try:
            if (model_dir / INDEX_FILE).is_file():
                weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
                return cls(model_dir, {name: model_dir / file for name, file in weight_map.items()}, dtype, device)
            if (model_dir / SINGLE_FILE).is_file():
                with safe_open(model_dir / SINGLE_FILE, framework="pt") as f:
                    return cls(model_dir, dict.fromkeys(f.keys(), model_dir / SINGLE_FILE), dtype, device)
        except (OSError, KeyError, json.JSONDecodeError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read the weights in {model_dir}: {exc}") from exc
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor as the checkpoint's dtype, or as `dtype` where a caller keeps it wider."""
        return self.raw(name).to(device=self.device, dtype=dtype or self.dtype)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as the file stores it (its dtype, on the host)."""
        return self._read(name, lambda f: f.get_tensor(name))

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Only [start, end) of dimension `dim` (0 or 1), read from the file without the rest (a tensor-parallel
        rank's share)."""
        index = (slice(start, end),) if dim == 0 else (slice(None), slice(start, end))
        tensor = self._read(name, lambda f: f.get_slice(name)[index])
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def _read(self, name: str, read) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise ModelLoadError(f"the checkpoint in {self.model_dir} has no tensor {name}")
        try:
            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            return read(self._open[path])
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read {name} from {path}: {exc}") from exc
