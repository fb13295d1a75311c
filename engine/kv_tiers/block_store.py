"""One KV tier: a directory of block files, shared by every process of a node that opens it.

A file holds one full block of one model: every layer's K and V, named by the block's chained hash (which already
covers the tenant's cache namespace and the adapter, engine/cache_namespace.py), and headed by the identity of what
wrote it (model, weights, dtype, layout), the block's tokens and an XXH3-64 checksum of both (tens of GB/s: CRC-32
at ~4 GB/s was a third of a load's time, profiled in docs/performance.md). A read checks all of them: a
missing, truncated, corrupt or mismatched file is a miss (and removed), never KV. Writes go to a temporary file
renamed into place, so readers in other processes see a whole file or none. The header is 64 bytes, so a block's
K and V start 64-byte aligned after its tokens (block sizes are multiples of 8): a reader reads a file straight into
its staging buffer and copies the KV from there (tier_io.py).

The directory is the index: `read_into` is an open, `put` a rename. A byte budget bounds it: past the budget the least
recently used files (by modification time, which a hit refreshes) go, moved to the tier below where there is one
(the host tier spills to disk). A write that fails (a full disk) is dropped, and the tier stops writing for a while:
serving never fails because a tier cannot take more.
"""

import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvloom.engine.kv_tiers.recent_hashes import RecentHashes

logger = logging.getLogger(__name__)

MAGIC = b"KVLOOM02"
# magic, identity, block hash, tokens, payload bytes, XXH3-64 of the tokens and payload; padded to 64 bytes
HEADER = struct.Struct("<8s16s16sIIQ8x")
SUFFIX = ".kvb"
FULL_BACKOFF_S = 30.0  # after a write fails for want of room, this long before the next try
CHECK_EVERY_BYTES_FRACTION = 16  # the directory is measured again after writes of budget / 16 bytes


@dataclass
class BlockStore:
    path: Path  # this identity's directory (created)
    budget_bytes: int
    identity: bytes  # 16 bytes: what wrote the blocks (tiers.py's `kv_identity`)
    below: "BlockStore | None" = None  # where blocks past the budget go
    _written_since_check: int = 0
    _measured_bytes: int = 0  # the directory's size when it was last measured
    _refused_until: float = 0.0
    seen: RecentHashes = field(default_factory=RecentHashes)  # blocks this process lately wrote, read or found here

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._measured_bytes = sum(size for _, size, _ in self._files())

    def file(self, block_hash: int) -> Path:
        return self.path / f"{block_hash:032x}{SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        held = self.file(block_hash).exists()
        if held:
            self.seen.saw(block_hash)
        return held

    def put(self, block_hash: int, tokens: tuple[int, ...], payload: memoryview) -> bool:
        """Store a block (a block already there is kept); False where it could not be written."""
        target = self.file(block_hash)
        if target.exists() or time.monotonic() < self._refused_until or len(payload) > self.budget_bytes:
            return False
        token_bytes = struct.pack(f"<{len(tokens)}q", *tokens)
        hasher = xxhash.xxh3_64(token_bytes)
        hasher.update(payload)
        checksum = hasher.intdigest()
        header = HEADER.pack(MAGIC, self.identity, block_hash.to_bytes(16, "little"), len(tokens), len(payload),
                             checksum)
        written = self._write(target, (header + token_bytes, payload))
        if written:
            self.seen.saw(block_hash)
        return written

    def read_into(self, block_hash: int, tokens: tuple[int, ...], out: memoryview) -> bool:
        """Read the block's file into `out` (exactly a file's size: `file_bytes`) if this tier holds it whole and
        for these tokens; its payload is then `out[payload_offset(len(tokens)):]`. A bad file goes."""
        target = self.file(block_hash)
        try:
            with open(target, "rb") as file:
                if os.fstat(file.fileno()).st_size != len(out):
                    usable = False
                else:
                    usable = file.readinto(out) == len(out) and self._verified(out, block_hash, tokens)
        except OSError:
            return False
        if not usable:
            logger.warning("KV tier %s: %s is not a usable block; removed", self.path, target.name)
            target.unlink(missing_ok=True)
            self.seen.lost(block_hash)
            return False
        try:
            os.utime(target)  # recently used: evicted last
        except OSError:
            pass
        self.seen.saw(block_hash)
        return True

    def _verified(self, data: memoryview, block_hash: int, tokens: tuple[int, ...]) -> bool:
        magic, identity, stored_hash, num_tokens, payload_bytes, checksum = HEADER.unpack_from(data)
        body = data[HEADER.size:]
        if (magic != MAGIC or identity != self.identity or stored_hash != block_hash.to_bytes(16, "little")
                or num_tokens != len(tokens) or len(body) != 8 * num_tokens + payload_bytes):
            return False
        if xxhash.xxh3_64_intdigest(body) != checksum:  # corruption, not forgery: only the node's replicas write here
            return False
        return struct.unpack_from(f"<{num_tokens}q", body) == tuple(tokens)

    def _write(self, target: Path, parts: tuple[bytes | memoryview, ...]) -> bool:
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as file:
                for part in parts:
                    file.write(part)
            os.replace(temporary, target)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            self._refused_until = time.monotonic() + FULL_BACKOFF_S
            logger.warning("KV tier %s takes no more blocks for %.0f s: %s", self.path, FULL_BACKOFF_S, exc)
            return False
        self._written_since_check += sum(len(part) for part in parts)
        if self._written_since_check * CHECK_EVERY_BYTES_FRACTION >= self.budget_bytes:
            self.trim()
        return True

    def trim(self) -> None:
        """Bring the directory within its budget: least recently used files first, to the tier below if any."""
        self._written_since_check = 0
        files = self._files()
        total = sum(size for _, size, _ in files)
        for _, size, name in sorted(files):
            if total <= self.budget_bytes:
                break
            self._evict(Path(name))
            total -= size
        self._measured_bytes = total

    def _files(self) -> list[tuple[float, int, str]]:
        """(modification time, size, path) of every block file in the directory."""
        files = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(SUFFIX):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                files.append((stat.st_mtime, stat.st_size, entry.path))
        return files

    def _evict(self, file: Path) -> None:
        if self.below is not None:
            try:
                data = file.read_bytes()
            except OSError:
                data = None
            if data is not None:
                self.below.take(file.name, data)
        file.unlink(missing_ok=True)
        self.seen.lost(int(file.stem, 16))

    def take(self, name: str, data: bytes) -> None:
        """Keep a block file another tier wrote (the same identity's, checked when it is read)."""
        if not (self.path / name).exists() and self._write(self.path / name, (data,)):
            self.seen.saw(int(Path(name).stem, 16))

    def used_bytes(self) -> int:
        """What the tier holds as this process last measured it, plus what it wrote since (no directory scan:
        engine stats read this every report)."""
        return self._measured_bytes + self._written_since_check


def payload_offset(num_tokens: int) -> int:
    """Where a block file's payload starts: after the header and the block's tokens."""
    return HEADER.size + 8 * num_tokens


def file_bytes(num_tokens: int, payload_bytes: int) -> int:
    return payload_offset(num_tokens) + payload_bytes
