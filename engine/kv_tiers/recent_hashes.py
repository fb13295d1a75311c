"""The hashes of the blocks this process lately wrote to, read from or found in a KV tier: what its replica tells the
router the node's tiers hold (router/replica_table.py counts them as cheaper prefix hits than the pool's).

Kept as the tier is used, so a report copies a bounded list instead of listing a directory several times a second.
A hint, not an index: what another process of the node evicts is not seen here, and a block that has gone is a
miss the engine computes, as a pool block evicted since the last report is.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

RECENT_LIMIT = 4096  # hashes kept per tier: as many as a replica reports of its pool (PREFIX_SUMMARY_SIZE)


@dataclass
class RecentHashes:
    limit: int = RECENT_LIMIT
    _order: OrderedDict = field(default_factory=OrderedDict)  # hash -> None, least recent first
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the engine's threads and its reports share it

    def saw(self, block_hash: int) -> None:
        """The tier holds this block now (written, read or found there)."""
        with self._lock:
            self._order[block_hash] = None
            self._order.move_to_end(block_hash)
            if len(self._order) > self.limit:
                self._order.popitem(last=False)

    def lost(self, block_hash: int) -> None:
        """The tier no longer holds it (evicted or found bad here)."""
        with self._lock:
            self._order.pop(block_hash, None)

    def latest(self, limit: int) -> list[int]:
        """At most `limit` hashes, the most recently seen last."""
        with self._lock:
            return list(self._order)[-limit:] if limit > 0 else []
