"""The torch.distributed KV transport between a prefill and a decode replica (gloo here; NCCL on CUDA is the
same code): one ordered channel per pair, in the order the decode side publishes. Many hand-offs in flight at once
arrive intact, each with its own request's KV, using no tag and one thread a side (what NCCL needs); a hand-off the
prefill side let go, a cancelled one and a broken channel fail only what they must, and the pair starts over."""

import asyncio
import random
import threading

import pytest
import torch
import torch.distributed as dist

from kvloom.engine.kv_handoff import DTYPE_CODES, KVHeader, KVTransferError
from kvloom.replicas import kv_transfer
from kvloom.replicas.kv_transfer import ReceiveLanes, SendLane

CPU = torch.device("cpu")
LOCAL = KVHeader(model_id=7, dtype=DTYPE_CODES[torch.float32], block_size=4, num_layers=2, num_kv_heads=1,
                 head_dim=4, num_tokens=0)


def kv_of(request_id: str, num_tokens: int) -> tuple[KVHeader, torch.Tensor]:
    """A request's KV, filled with a value of its own so a swap between requests shows."""
    header = KVHeader(**{**LOCAL.__dict__, "num_tokens": num_tokens})
    return header, torch.full(header.payload_shape(), float(abs(hash(request_id)) % 1000))


class Parked:
    """The prefill side's parked KV, exported as a send lane asks for it."""

    def __init__(self) -> None:
        self.kv: dict[str, tuple[KVHeader, torch.Tensor]] = {}
        self.calls: list[list[str]] = []

    def export(self, request_ids: list[str]) -> list:
        self.calls.append(request_ids)
        return [self.kv.get(r) for r in request_ids]


@pytest.fixture
def pair(monkeypatch):
    """A decode replica's lanes and a prefill replica's send lane to it, 127.0.0.1 for the node's address."""
    monkeypatch.setattr(kv_transfer.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    lanes = ReceiveLanes("decode-1", CPU, timeout_s=2)
    parked = Parked()
    SendLane("prefill-0", "decode-1", lanes.address, CPU, 2, parked.export)
    return lanes, parked


async def test_64_hand_offs_in_flight_at_once_each_get_their_own_kv(pair):
    lanes, parked = pair
    lengths = {f"r{i}": random.Random(i).randint(1, 40) for i in range(64)}  # equal and different block counts
    for request_id, num_tokens in lengths.items():
        parked.kv[request_id] = kv_of(request_id, num_tokens)
    received = await asyncio.gather(*(lanes.receive("prefill-0", r, LOCAL) for r in lengths))
    for (request_id, num_tokens), (header, payload) in zip(lengths.items(), received):
        assert header.num_tokens == num_tokens and torch.equal(payload, parked.kv[request_id][1])
    assert max(map(len, parked.calls)) > 1  # notices published together are exported together


async def test_every_operation_uses_no_tag_and_one_thread_a_side(pair, monkeypatch):
    """What NCCL requires: it ignores tags, and its communicators take one thread's operations at a time."""
    lanes, parked = pair
    seen = []

    class Recording:
        def __init__(self, group):
            self.group = group

        def send(self, tensors, peer, tag):
            seen.append(("send", tag, threading.get_ident()))
            return self.group.send(tensors, peer, tag)

        def recv(self, tensors, peer, tag):
            seen.append(("recv", tag, threading.get_ident()))
            return self.group.recv(tensors, peer, tag)

    join = kv_transfer._join
    monkeypatch.setattr(kv_transfer, "_join", lambda *args: Recording(join(*args)))
    request_ids = [f"r{i}" for i in range(16)]
    for request_id in request_ids:
        parked.kv[request_id] = kv_of(request_id, 9)
    await asyncio.gather(*(lanes.receive("prefill-0", r, LOCAL) for r in request_ids))
    assert {tag for _, tag, _ in seen} == {0}
    assert {op: len({thread for o, _, thread in seen if o == op}) for op in ("send", "recv")} == {"send": 1, "recv": 1}


async def test_a_hand_off_the_prefill_side_let_go_fails_alone(pair):
    lanes, parked = pair
    parked.kv["kept"] = kv_of("kept", 5)
    gone, kept = await asyncio.gather(lanes.receive("prefill-0", "gone", LOCAL), lanes.receive("prefill-0", "kept", LOCAL),
                                      return_exceptions=True)
    assert isinstance(gone, KVTransferError) and "no longer holds the KV of gone" in str(gone)
    assert torch.equal(kept[1], parked.kv["kept"][1])


async def test_a_cancelled_receive_keeps_the_channel_in_step(pair):
    lanes, parked = pair
    for request_id in ("cancelled", "next"):
        parked.kv[request_id] = kv_of(request_id, 7)
    cancelled = asyncio.ensure_future(lanes.receive("prefill-0", "cancelled", LOCAL))
    await asyncio.sleep(0)
    cancelled.cancel()
    _, payload = await lanes.receive("prefill-0", "next", LOCAL)
    assert torch.equal(payload, parked.kv["next"][1])


async def test_a_prefill_side_that_never_sends_fails_the_receive_naming_it_and_the_pair_starts_over(monkeypatch):
    monkeypatch.setattr(kv_transfer.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    lanes = ReceiveLanes("decode-1", CPU, timeout_s=1)
    with pytest.raises(KVTransferError, match="KV transfer with replica prefill-0: receiving the KV of r0 failed"):
        await asyncio.wait_for(lanes.receive("prefill-0", "r0", LOCAL), 30)
    parked = Parked()  # the prefill side comes now: the next generation serves it
    parked.kv["r1"] = kv_of("r1", 3)
    SendLane("prefill-0", "decode-1", lanes.address, CPU, 1, parked.export)
    _, payload = await asyncio.wait_for(lanes.receive("prefill-0", "r1", LOCAL), 30)
    assert torch.equal(payload, parked.kv["r1"][1])


async def test_a_send_lane_ends_when_its_decode_replicas_store_is_gone():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lane = SendLane("prefill-0", "decode-1", f"127.0.0.1:{store.port}", CPU, 1, Parked().export)
    del store
    await asyncio.wait_for(asyncio.to_thread(lane.thread.join), 30)
    assert not lane.alive
