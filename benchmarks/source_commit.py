"""The kvloom commit a report was made from, named in every committed report."""

import os
import subprocess
from pathlib import Path


def source_commit() -> str:
    """The commit (`-dirty` with uncommitted changes), or `unknown` outside git. KVLOOM_SOURCE_COMMIT names it where
    the tree was copied without its history (the device check: the copy's git metadata can be older than its files)."""
    if named := os.environ.get("KVLOOM_SOURCE_COMMIT"):
        return named
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head
