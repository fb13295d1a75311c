"""A replica's output channels over its TCP socket (replicas/output_socket.py), and the router's way to them
(router/channels.py), without Ray: real sockets on loopback, a scripted engine behind the server and a scripted
Serve handle in front of the router."""

import asyncio
import json

import pytest

from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.messages import Chunk, OutputAddress, StepChunks, SubmitReply, SubmitRequest
from kvloom.replicas.output_socket import FRAME, SECRET_BYTES, OutputServer, SocketSteps
from kvloom.router.channels import ReplicaChannels


class ScriptedSteps:
    """A replica's channels: each yields what the test puts in its queue; `ended` is set as one's steps close."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.ended: dict[str, asyncio.Event] = {}

    async def __call__(self, channel: str):
        queue = self.queues.setdefault(channel, asyncio.Queue())
        self.ended[channel] = asyncio.Event()
        try:
            while (step := await queue.get()) is not None:
                yield step
        finally:
            self.ended[channel].set()


def step(request_id: str, token: int) -> StepChunks:
    return StepChunks("r", [Chunk("r", request_id, f"t{token}", [token], [{token: -0.5}], completion_tokens=token)])


async def hello_bytes(secret: bytes, channel: str) -> bytes:
    body = json.dumps({"channel": channel}).encode()
    return secret + FRAME.pack(len(body)) + body


async def test_a_leased_channels_steps_arrive_in_order_as_they_were_sent():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    address = await server.address()
    server.lease("ch")
    source.queues["ch"] = queue = asyncio.Queue()
    sent = [step(f"q{i % 3}", i) for i in range(50)]
    for item in sent + [None]:
        queue.put_nowait(item)
    received = [s async for s in await SocketSteps.open(address, "ch")]
    assert received == sent


@pytest.mark.parametrize("secret_ok, leased", [(False, True), (True, False)])
async def test_a_connection_without_the_secret_or_a_lease_gets_no_byte_and_is_closed(secret_ok, leased):
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    address = await server.address()
    if leased:
        server.lease("ch")
    source.queues["ch"] = asyncio.Queue()
    source.queues["ch"].put_nowait(step("q", 1))
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(await hello_bytes(address.secret if secret_ok else bytes(SECRET_BYTES), "ch"))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # the end of the stream, and nothing before it
    writer.close()
    assert "ch" not in source.ended  # its steps never started


async def test_the_router_closing_the_socket_ends_the_channels_steps_and_the_lease():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    address = await server.address()
    lease_ended = server.lease("ch")
    source.queues["ch"] = asyncio.Queue()
    source.queues["ch"].put_nowait(step("q", 1))
    steps = await SocketSteps.open(address, "ch")
    async for received in steps:
        assert received == step("q", 1)
        break  # leaving the loop closes the socket
    await asyncio.wait_for(source.ended["ch"].wait(), 10)  # closing the steps is what aborts the requests left
    await asyncio.wait_for(lease_ended.wait(), 10)


async def test_the_end_of_a_lease_closes_the_socket_and_the_routers_steps_end():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    address = await server.address()
    server.lease("ch")
    source.queues["ch"] = asyncio.Queue()
    source.queues["ch"].put_nowait(step("q", 1))
    steps = await SocketSteps.open(address, "ch")
    received = []
    async for item in steps:
        received.append(item)
        server.release("ch")  # the router's lease ended: its Ray stream was cancelled or its router is gone
    assert received == [step("q", 1)]
    await asyncio.wait_for(source.ended["ch"].wait(), 10)


class LeaseStream:
    """Serve's streaming response for `outputs`: a hello, then (`socket`) nothing until cancelled, or the steps."""

    def __init__(self, hello: StepChunks, steps: list[StepChunks]) -> None:
        self.items, self.cancelled = [hello, *steps], asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self):
        for item in self.items:
            yield item
        await self.cancelled.wait()


class ScriptedReplica:
    """Serve's handle to replica "r", which offers `address` for its socket (None: it offers none)."""

    def __init__(self, address: OutputAddress | None, steps: list[StepChunks]) -> None:
        self.address, self.steps, self.leases = address, steps, []

    def options(self, **options) -> "ScriptedReplica":
        return self

    @property
    def submit(self):
        async def remote(message, channel, target_replica=None):
            return SubmitReply("r")
        return type("Call", (), {"remote": staticmethod(remote)})

    @property
    def outputs(self):
        def remote(channel, target_replica=None, caller=None, socket=False):
            stream = LeaseStream(StepChunks("r", address=self.address if socket else None),
                                 [] if socket and self.address else self.steps)
            self.leases.append((socket, stream))
            return stream
        return type("Call", (), {"remote": staticmethod(remote)})


def request(request_id: str) -> SubmitRequest:
    return SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2))


def last(request_id: str, token: int) -> StepChunks:
    return StepChunks("r", [Chunk("r", request_id, "x", [token], finish_reason="length", completion_tokens=2)])


async def test_the_router_reads_a_channel_over_the_socket_while_its_ray_stream_stays_open_as_the_lease():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    address = await server.address()
    handle = ScriptedReplica(address, [])
    channels = ReplicaChannels(handle)
    source.queues[channels.channel_id] = queue = asyncio.Queue()
    server.lease(channels.channel_id)
    queue.put_nowait(step("a", 1))
    queue.put_nowait(last("a", 2))
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]
    assert [c.token_ids for c in chunks] == [[1], [2]]
    (socket, lease), = handle.leases
    assert socket and not lease.cancelled.is_set()  # the channel stays open for the replica's next requests
    channels.close("r", ConnectionError("closed by the test"))
    await asyncio.wait_for(source.ended[channels.channel_id].wait(), 10)  # the socket closed: the replica aborts
    await asyncio.wait_for(lease.cancelled.wait(), 10)


async def test_a_socket_the_router_cannot_reach_leaves_the_outputs_on_the_ray_stream():
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()  # nothing listens there any more
    handle = ScriptedReplica(OutputAddress("127.0.0.1", port, b"s" * SECRET_BYTES), [step("a", 1), last("a", 2)])
    channels = ReplicaChannels(handle)
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]
    assert [c.token_ids for c in chunks] == [[1], [2]]
    (socket_lease, first), (over_ray, _) = handle.leases
    assert socket_lease and first.cancelled.is_set() and not over_ray


async def test_a_replica_that_offers_no_socket_sends_its_steps_on_the_ray_stream():
    handle = ScriptedReplica(None, [step("a", 1), last("a", 2)])
    channels = ReplicaChannels(handle)
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]
    assert [c.token_ids for c in chunks] == [[1], [2]]
    (socket, _), = handle.leases  # the stream that asked for the socket carried the steps: no second one
    assert socket
