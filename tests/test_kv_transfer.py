"""The torch.distributed KV transport between a prefill and a decode replica (gloo here; NCCL on CUDA is the
same code): a pair's group forms on both sides at once, the header and the KV arrive intact, and every wait
ends within the transfer timeout in an error naming the peer replica, never a hang."""

import asyncio
import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from kvloom.engine.kv_handoff import DTYPE_CODES, KVHeader, KVTransferError
from kvloom.replicas import kv_transfer
from kvloom.replicas.kv_transfer import PairGroups, recv_header, recv_payload, send_kv

CPU = torch.device("cpu")
HEADER = KVHeader(model_id=7, dtype=DTYPE_CODES[torch.float32], block_size=4, num_layers=2, num_kv_heads=1,
                  head_dim=4, num_tokens=5)


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(kv_transfer, "TRANSFER_TIMEOUT", datetime.timedelta(seconds=1))


async def pair() -> tuple:
    """A decode replica hosting its store and a prefill replica, their pair's group built on both sides."""
    decode, prefill = PairGroups("decode-1", CPU), PairGroups("prefill-0", CPU)
    decode.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=kv_transfer.TRANSFER_TIMEOUT)
    return await asyncio.gather(prefill.group("prefill-0", "decode-1", f"127.0.0.1:{decode.store.port}"),
                                decode.group("prefill-0", "decode-1", None))


async def test_the_header_and_the_kv_arrive_intact():
    sending, receiving = await pair()
    payload = torch.randn(HEADER.payload_shape())

    async def receive():
        header = await recv_header(receiving, 3, CPU, "prefill-0")
        return header, await recv_payload(receiving, 3, header, torch.float32, CPU, "prefill-0")

    _, (header, received) = await asyncio.gather(send_kv(sending, 3, HEADER, payload, "decode-1"), receive())
    assert header == HEADER and torch.equal(received, payload)


async def test_a_peer_that_never_sends_fails_the_receive_naming_it(short_timeout):
    _, receiving = await pair()
    with pytest.raises(KVTransferError, match="replica prefill-0: receiving the header failed within 1 s"):
        await asyncio.wait_for(recv_header(receiving, 0, CPU, "prefill-0"), 30)


async def test_a_decode_replica_whose_store_is_gone_fails_the_prefill_side_naming_it(short_timeout):
    with socket.socket() as placeholder:  # a port nothing listens on
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    with pytest.raises(KVTransferError, match=f"replica decode-1: connecting to its store at 127.0.0.1:{port}"):
        await asyncio.wait_for(PairGroups("prefill-0", CPU).group("prefill-0", "decode-1", f"127.0.0.1:{port}"), 30)
