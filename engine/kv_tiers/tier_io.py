"""The KV tiers' reads and writes, off the engine's step: one worker thread does them in order.

A step that completes blocks copies their KV out of the pool (a copy, while the blocks are surely still theirs) and
hands the files' writing to the worker. A request whose prefix a tier holds is admitted with blocks for all of it,
then waits out of the batch (as vLLM's requests waiting for remote KV) while the worker reads the tier's blocks
into its blocks (`TierLoad`), and the steps go on for everyone else; the scheduler takes finished loads in at its
next step (`KVCacheManager.end_tier_loads`), and the request runs from there. Writes that fall more than
`MAX_PENDING_WRITE_BYTES` behind are dropped (and counted): a slow tier costs hits, never memory or time.
"""

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvloom.engine.block_pool import KVBlock
from kvloom.engine.kv_tiers.tiers import KVTiers
from kvloom.engine.request import Request

logger = logging.getLogger(__name__)

MAX_PENDING_WRITE_BYTES = 256 << 20


@dataclass
class TierLoad:
    """A request's prefix blocks being read from the tiers."""
    request: Request
    blocks: list[KVBlock]  # the request's blocks the run is read into, one per wanted block
    wanted: list[tuple[int, tuple[int, ...]]]  # (hash, tokens) of the run
    done: Future
    cancelled: bool = False  # its request ended while the worker read: nothing is registered
    released: list[KVBlock] = field(default_factory=list)  # a cancelled request's blocks, freed when the load ends

    def loaded(self) -> int:
        """How many leading blocks the worker read (0 where it failed)."""
        try:
            return self.done.result()
        except Exception:
            logger.exception("KV tier load for %s failed; its prefix is computed", self.request.request_id)
            return 0


class TierIO:
    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="kvloom-kv-tiers")
        self.loads: dict[str, TierLoad] = {}  # by request id, cancelled ones under a key of their own
        self.reading: set[int] = set()  # hashes of the blocks being loaded (a request needing one waits for it)
        self.finished = threading.Event()  # a load ended since the engine last looked
        self._pending_write_bytes = 0
        self._lock = threading.Lock()
        self._last: Future | None = None  # the latest work handed to the worker

    def write(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Newly computed full blocks (block id, hash, tokens): copied out now, written by the worker."""
        blocks = self.tiers.new_blocks(blocks)
        if not blocks:
            return
        size = len(blocks) * self.tiers.payload_bytes
        with self._lock:
            if self._pending_write_bytes + size > MAX_PENDING_WRITE_BYTES:
                self.tiers.stats[next(iter(self.tiers.stores))].writes_dropped += len(blocks)
                return
            self._pending_write_bytes += size
        payload = self.tiers.export_blocks([block_id for block_id, _, _ in blocks]).cpu()
        self._submit(self._write, [(block_hash, tokens) for _, block_hash, tokens in blocks], payload, size)

    def _write(self, blocks: list[tuple[int, tuple[int, ...]]], payload: torch.Tensor, size: int) -> None:
        try:
            self.tiers.write(blocks, payload)
        finally:
            with self._lock:
                self._pending_write_bytes -= size

    def load(self, request: Request, blocks: list[KVBlock], wanted: list[tuple[int, tuple[int, ...]]]) -> TierLoad:
        done = self._submit(self.tiers.load, wanted, [block.block_id for block in blocks])
        load = self.loads[request.request_id] = TierLoad(request, blocks, wanted, done)
        self.reading.update(block_hash for block_hash, _ in wanted)
        done.add_done_callback(lambda _: self.finished.set())
        return load

    def cancel(self, request_id: str, held: list[KVBlock]) -> bool:
        """The request ended: if it has a load, the blocks it `held` are freed once the worker is done with them
        (True), not before (the worker may be writing them)."""
        load = self.loads.pop(request_id, None)
        if load is None:
            return False
        load.cancelled, load.released = True, held
        self.loads[f"cancelled:{id(load)}"] = load
        return True

    def take_finished(self) -> list[TierLoad]:
        """The loads the worker has finished, no longer tracked."""
        self.finished.clear()
        ended = [self.loads.pop(key) for key, load in list(self.loads.items()) if load.done.done()]
        for load in ended:
            self.reading.difference_update(block_hash for block_hash, _ in load.wanted)
        return ended

    def wait(self, timeout: float) -> None:
        """Until a load ends (or `timeout` seconds): for a step with nothing to run but loads in flight."""
        self.finished.wait(timeout)

    def drain(self) -> None:
        """Until everything handed to the worker so far is done (tests, shutdown)."""
        if self._last is not None:
            self._last.exception()

    def close(self) -> None:
        """Finish what was handed to the worker and stop it (the engine's end: no file left half-written)."""
        self.worker.shutdown(wait=True)

    def _submit(self, fn, *args) -> Future:
        self._last = self.worker.submit(fn, *args)
        return self._last

    @property
    def pinned_blocks(self) -> int:
        """Pool blocks the worker may be writing: those of loads in flight or not yet taken in."""
        return sum(len(load.blocks) for load in self.loads.values())

    def as_dict(self) -> dict:
        return {"loads_in_flight": len(self.loads), "pinned_blocks": self.pinned_blocks}
