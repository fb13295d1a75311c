"""An adapter's identity in block hashes, computed alike by replicas and the router (which never imports torch).

The same tokens under two adapters give different KV, so a prompt's block-hash chain starts from a root that
names the adapter and its weights (the base model's chain starts from none): the engine's prefix cache never
mixes them, and the router's prefix affinity finds the replica holding that adapter's blocks.
"""

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoRARequest(BaseModel):
    """The adapter a request runs with: its name and, where the caller knows it (the router does), its directory;
    without one the engine finds it by name (registered, or under its dynamic loading path)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: str | None = None


def weights_digest(weights_file: Path) -> bytes:
    """The SHA-256 of the weights file's bytes (read in chunks; hashing releases the GIL, so a loader hashes on one
    thread while it reads the tensors on another)."""
    digest = hashlib.sha256()
    with weights_file.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.digest()


def cache_root(name: str, digest: bytes) -> int:
    """A 128-bit root for the adapter's prompts: its name and its weights' `weights_digest`."""
    root = hashlib.blake2b(name.encode(), digest_size=16)
    root.update(digest)
    return int.from_bytes(root.digest(), "little")


def cache_root_of(name: str, adapter_dir: str | Path) -> int:
    return cache_root(name, weights_digest(Path(adapter_dir) / WEIGHTS_FILE))


def adapters_under(root: str | None) -> dict[str, Path]:
    """The adapters in a dynamic loading path: each sub-directory holding an adapter config, by its name."""
    return {p.parent.name: p.parent for p in Path(root).glob(f"*/{CONFIG_FILE}")} if root else {}


def adapter_under(root: str | None, name: str) -> Path | None:
    """`root/name` where it holds an adapter; a name that is not a plain one (no way out of `root`) finds none."""
    if root is None or "/" in name or "\\" in name or name.startswith("."):
        return None
    path = Path(root) / name
    return path if (path / CONFIG_FILE).is_file() else None
