"""KV transports between a prefill and a decode replica.

`torch_distributed`: point-to-point send/recv over a two-rank process group per (prefill, decode)
pair, gloo on CPU and NCCL on CUDA through the same code. Each decode replica hosts a TCPStore on
a port chosen at run time and publishes its address; a pair's group is built lazily, on both
sides at once, the first time the pair transfers. The header travels first and is checked
before the payload is used. Every wait (the store, the group's rendezvous, each send and receive) has a
timeout, on NCCL as on gloo, and its error names the peer replica: a dead peer ends in an error, not a hang.

`object_store`: the prefill side puts the payload in Ray's object store; the decode side gets it.
"""

import asyncio
import datetime
from dataclasses import dataclass, field

import ray
import torch
import torch.distributed as dist

from kvloom.engine.kv_handoff import KVHeader, KVTransferError

TRANSFER_TIMEOUT = datetime.timedelta(seconds=10)  # a dead peer fails a transfer, never hangs it
HEADER_FIELDS = 7


def _process_group(store, rank: int, device: torch.device):
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TRANSFER_TIMEOUT  # NCCL's own default is minutes
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, TRANSFER_TIMEOUT)


async def _within_timeout(what: str, peer: str, call):
    """Run a blocking call off the event loop; any failure (a timeout among them) becomes a KVTransferError
    naming the peer replica."""
    try:
        return await asyncio.to_thread(call)
    except Exception as exc:
        raise KVTransferError(f"KV transfer with replica {peer}: {what} failed within "
                              f"{TRANSFER_TIMEOUT.total_seconds():g} s ({exc})") from exc


@dataclass
class PairGroups:
    """This replica's two-rank groups, one per peer; the decode side also hosts the store."""

    replica_id: str
    device: torch.device
    store: dist.TCPStore | None = None
    _groups: dict[str, object] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def host_store(self) -> str:
        """Start this (decode) replica's rendezvous store on a free port; returns host:port."""
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TRANSFER_TIMEOUT)
        return f"{host}:{self.store.port}"

    async def group(self, prefill_id: str, decode_id: str, store_address: str | None):
        """The pair's group; prefill is rank 0 and connects to the decode side's store."""
        peer = decode_id if store_address else prefill_id
        lock = self._locks.setdefault(peer, asyncio.Lock())
        async with lock:
            if peer not in self._groups:
                if store_address:
                    host, port = store_address.rsplit(":", 1)
                    store = await _within_timeout(f"connecting to its store at {store_address}", peer, lambda: (
                        dist.TCPStore(host, int(port), is_master=False, timeout=TRANSFER_TIMEOUT)))
                    rank = 0
                else:
                    store, rank = self.store, 1
                prefixed = dist.PrefixStore(f"kvloom/{prefill_id}/{decode_id}", store)
                self._groups[peer] = await _within_timeout("joining the pair's group", peer,
                                                           lambda: _process_group(prefixed, rank, self.device))
            return self._groups[peer]

    def forget(self, peer: str) -> None:
        """Drop a pair whose peer failed; the next transfer builds a fresh group."""
        self._groups.pop(peer, None)


async def send_kv(group, tag: int, header: KVHeader, payload: torch.Tensor, peer: str) -> None:
    """Prefill side: header, then payload, to rank 1 (the decode replica `peer`)."""
    header_tensor = header.to_tensor().to(payload.device)
    await _within_timeout("sending the header", peer, lambda: group.send([header_tensor], 1, 2 * tag).wait(
        TRANSFER_TIMEOUT))
    await _within_timeout("sending the KV", peer, lambda: group.send([payload.contiguous()], 1, 2 * tag + 1).wait(
        TRANSFER_TIMEOUT))


async def recv_header(group, tag: int, device: torch.device, peer: str) -> KVHeader:
    buffer = torch.zeros(HEADER_FIELDS, dtype=torch.int64, device=device)
    await _within_timeout("receiving the header", peer, lambda: group.recv([buffer], 0, 2 * tag).wait(
        TRANSFER_TIMEOUT))
    return KVHeader.from_tensor(buffer.cpu())


async def recv_payload(group, tag: int, header: KVHeader, dtype: torch.dtype, device: torch.device,
                       peer: str) -> torch.Tensor:
    buffer = torch.empty(header.payload_shape(), dtype=dtype, device=device)
    await _within_timeout("receiving the KV", peer, lambda: group.recv([buffer], 0, 2 * tag + 1).wait(
        TRANSFER_TIMEOUT))
    return buffer
