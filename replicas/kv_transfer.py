"""The torch.distributed KV transport between a prefill and a decode replica: gloo on CPU, NCCL on CUDA, one code.

Each (prefill, decode) pair has one ordered channel, built so that it relies on nothing NCCL lacks:
- One thread a side issues every operation on the pair's two-rank group (the prefill side's `SendLane`, the
  decode side's `ReceiveLane`), so sends and receives pair up in the order they are issued; no tag is used
  (NCCL ignores them) and no thread pool shared with anything else is waited on.
- The decode side sets the order. Once it has reserved a request's blocks it publishes `ready/<gen>/<seq>` =
  the request's id in the TCPStore it hosts; the prefill side serves the notices in `seq` order, each as a
  frame (the request's key and its KV header; no KV when it no longer holds it) then the KV. The receiver checks
  the key, so a channel out of step fails instead of decoding on another request's KV.
- Deadlines hold on the host: gloo's wait blocks with a timeout; NCCL's only orders the stream, so the host
  polls the operation's completion against the deadline and aborts the group when it passes.
- A failure ends the pair's generation on both sides: the transfers it took raise `KVTransferError` naming the
  peer, the decode side publishes `ended/<gen>` and its next hand-off builds a group under the next generation,
  which the prefill side joins. Nothing tears down a replica.

The decode replica hosts the store on a port chosen at run time and publishes its address in its stats.
"""

import asyncio
import datetime
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
import torch.distributed as dist

from kvloom.engine.kv_handoff import KVHeader, KVTransferError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
FRAME_FIELDS = 8  # the request's key, then KVHeader's seven fields
NOTICES_PER_EXPORT = 8  # ready notices the prefill side exports in one call on its engine
# the prefill side polls the store for notices: a TCPStore wait that times out logs a warning each time
POLL_S = 0.001
IDLE_POLL_S = 0.02


def request_key(request_id: str) -> int:
    """A 63-bit digest of a request id: what a frame says it carries."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1


def transfer_error(peer: str, what: str, exc: BaseException | str) -> KVTransferError:
    return KVTransferError(f"KV transfer with replica {peer}: {what} failed ({exc})")


def _join(store, generation: int, rank: int, device: torch.device, timeout_s: float):
    """The pair's two-rank group of one generation; prefill is rank 0. The decode side waits twice as long to meet:
    a prefill side still failing a dead generation's rendezvous comes within one timeout."""
    prefixed = dist.PrefixStore(f"group/{generation}", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        # the host enforces the deadline and aborts the group; NCCL's watchdog, whose own timeout ends the
        # process, must never fire first
        options._timeout = datetime.timedelta(seconds=4 * timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, datetime.timedelta(seconds=timeout_s * (1 + rank)))


def _complete(work, group, device: torch.device, timeout_s: float) -> None:
    """Block the host until a send or receive is done, or raise once the deadline passes."""
    if device.type != "cuda":
        work.wait(datetime.timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            group.abort()
            raise TimeoutError(f"not done within {timeout_s:g} s")
        time.sleep(POLL_S)


def _pair_store(store, prefill_id: str, decode_id: str):
    return dist.PrefixStore(f"kvloom/{prefill_id}/{decode_id}", store)


class ReceiveLane:
    """The decode side of one pair in one generation: the order of its transfers and the thread receiving them."""

    def __init__(self, store, prefill_id: str, decode_id: str, generation: int, device: torch.device,
                 timeout_s: float) -> None:
        self.pair = _pair_store(store, prefill_id, decode_id)
        self.peer = prefill_id
        self.generation = generation
        self.device = device
        self.timeout_s = timeout_s
        self.seq = 0  # the next transfer's place in the order
        self.failed: KVTransferError | None = None
        self._group = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"kv-receive-{prefill_id[:8]}")
        self.pair.set("generation", str(generation))

    async def receive(self, request_id: str, local: KVHeader) -> tuple[KVHeader, torch.Tensor]:
        """Publish the request's place in the order and wait for its KV. A cancelled wait leaves the receive in
        place (its KV is read and dropped), so the channel stays in step."""
        if self.failed is not None:
            raise self.failed
        seq, self.seq = self.seq, self.seq + 1
        self.pair.set(f"ready/{self.generation}/{seq}", request_id)
        return await asyncio.shield(asyncio.wrap_future(self._thread.submit(self._receive, request_id, local)))

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    def _receive(self, request_id: str, local: KVHeader) -> tuple[KVHeader, torch.Tensor]:
        if self.failed is not None:
            raise self.failed
        payload = None
        try:
            if self._group is None:
                self._group = _join(self.pair, self.generation, 1, self.device, self.timeout_s)
            frame = torch.zeros(FRAME_FIELDS, dtype=torch.int64, device=self.device)
            _complete(self._group.recv([frame], 0, 0), self._group, self.device, self.timeout_s)
            key, header = int(frame[0]), KVHeader.from_tensor(frame[1:].cpu())
            if key != request_key(request_id):
                raise KVTransferError(f"the frame for {request_id} carries another request's KV")
            if header.num_tokens:  # none: the prefill side had let it go (the router gave the request up)
                payload = torch.empty(header.payload_shape(), dtype=header.torch_dtype, device=self.device)
                _complete(self._group.recv([payload], 0, 0), self._group, self.device, self.timeout_s)
        except Exception as exc:
            self.failed = transfer_error(self.peer, f"receiving the KV of {request_id}", exc)
            self.pair.set(f"ended/{self.generation}", "")  # the prefill side starts over
            raise self.failed from exc
        if payload is None:
            raise KVTransferError(f"replica {self.peer} no longer holds the KV of {request_id}")
        header.check_matches(local)  # after the payload is read: the channel stays in step
        return header, payload


class ReceiveLanes:
    """A decode replica's lanes, one per prefill peer, and the store the pairs meet at."""

    def __init__(self, decode_id: str, device: torch.device, timeout_s: float) -> None:
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.address = f"{host}:{self.store.port}"
        self.decode_id = decode_id
        self.device = device
        self.timeout_s = timeout_s
        self._lanes: dict[str, ReceiveLane] = {}
        self._generations: dict[str, int] = {}

    async def receive(self, prefill_id: str, request_id: str, local: KVHeader) -> tuple[KVHeader, torch.Tensor]:
        """The request's KV from `prefill_id`, in the pair's order; a failed lane is replaced by the next generation's."""
        lane = self._lanes.get(prefill_id)
        if lane is None or lane.failed is not None:
            if lane is not None:
                lane.close()
            generation = self._generations[prefill_id] = self._generations.get(prefill_id, -1) + 1
            lane = self._lanes[prefill_id] = ReceiveLane(self.store, prefill_id, self.decode_id, generation,
                                                         self.device, self.timeout_s)
        return await lane.receive(request_id, local)


Export = Callable[[list[str]], list[tuple[KVHeader, torch.Tensor] | None]]


class SendLane:
    """The prefill side of one pair: one thread that serves the decode side's ready notices in their order, for as
    long as the decode replica's store answers."""

    def __init__(self, prefill_id: str, decode_id: str, store_address: str, device: torch.device, timeout_s: float,
                 export: Export) -> None:
        self.prefill_id, self.peer, self.store_address = prefill_id, decode_id, store_address
        self.device = device
        self.timeout_s = timeout_s
        self.export = export  # request ids -> their (header, KV), None for one no longer parked: on the engine
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{decode_id[:8]}", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        try:
            host, port = self.store_address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            pair = _pair_store(store, self.prefill_id, self.peer)
            generation = -1
            while True:
                generation = self._next_generation(pair, generation)
                try:
                    self._serve(pair, generation)
                except KVTransferError as exc:
                    logger.warning("%s; the pair starts over", exc)
        except dist.DistNetworkError as exc:
            logger.info("KV send lane to replica %s ends: its store is gone (%s)", self.peer, exc)
        except Exception:
            logger.exception("KV send lane to replica %s failed", self.peer)

    @staticmethod
    def _next_generation(pair, after: int) -> int:
        """Wait for the decode side to open a generation later than `after` (one that has not ended yet)."""
        while True:
            if pair.check(["generation"]):
                generation = int(pair.get("generation"))
                if generation > after and not pair.check([f"ended/{generation}"]):
                    return generation
            time.sleep(IDLE_POLL_S)

    def _serve(self, pair, generation: int) -> None:
        """Serve one generation's notices until its end (or a failure, raised as KVTransferError)."""
        try:
            group = _join(pair, generation, 0, self.device, self.timeout_s)
        except Exception as exc:
            raise transfer_error(self.peer, "joining the pair's group", exc) from exc
        seq = 0
        while True:
            request_ids = self._notices(pair, generation, seq)
            if not request_ids:
                return
            for request_id, exported in zip(request_ids, self.export(request_ids)):
                self._send(group, request_id, exported)
            seq += len(request_ids)

    def _notices(self, pair, generation: int, seq: int) -> list[str]:
        """The request ids of the notices published from `seq` on (waiting for the first); none once the decode
        side ended the generation."""
        idle_since = time.monotonic()
        while not pair.check([f"ready/{generation}/{seq}"]):
            if pair.check([f"ended/{generation}"]):
                return []
            time.sleep(POLL_S if time.monotonic() - idle_since < 1 else IDLE_POLL_S)
        request_ids = []
        while len(request_ids) < NOTICES_PER_EXPORT and pair.check([key := f"ready/{generation}/{seq + len(request_ids)}"]):
            request_ids.append(pair.get(key).decode())
            pair.delete_key(key)
        return request_ids

    def _send(self, group, request_id: str, exported: tuple[KVHeader, torch.Tensor] | None) -> None:
        header = exported[0] if exported is not None else KVHeader(0, 0, 0, 0, 0, 0, 0)
        frame = torch.tensor([request_key(request_id), *header.to_tensor().tolist()], dtype=torch.int64,
                             device=self.device)
        try:
            _complete(group.send([frame], 1, 0), group, self.device, self.timeout_s)
            if exported is not None:
                _complete(group.send([exported[1].contiguous()], 1, 0), group, self.device, self.timeout_s)
        except Exception as exc:
            raise transfer_error(self.peer, f"sending the KV of {request_id}", exc) from exc
