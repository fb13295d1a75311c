"""A replica's output channels over its TCP socket (replicas/output_socket.py), and the router's way to them
(router/channels.py), without Ray: real sockets on loopback, a scripted engine behind the server and a scripted
Serve handle in front of the router."""

import asyncio

import pytest

from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.messages import Chunk, OutputAddress, StepChunks, SubmitReply, SubmitRequest
from kvloom.replicas.output_socket import TOKEN_BYTES, OutputServer, SocketSteps
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


async def leased(server: OutputServer, source: ScriptedSteps, channel: str, *steps: StepChunks | None):
    """A lease on `channel` whose steps will be `steps`, and the address its reader is given."""
    lease = server.lease(channel)
    source.queues[channel] = queue = asyncio.Queue()
    for item in steps:
        queue.put_nowait(item)
    return lease, await server.address(lease)


async def test_a_leased_channels_steps_arrive_in_order_as_they_were_sent():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    sent = [step(f"q{i % 3}", i) for i in range(50)]
    _, address = await leased(server, source, "ch", *sent, None)
    received = [s async for s in await SocketSteps.open(address)]
    assert received == sent


@pytest.mark.parametrize("token", ["wrong", "used"])
async def test_a_connection_without_a_live_token_gets_no_byte_and_is_closed(token):
    """A token opens one connection, once: a second one with it, or one with any other, is closed unanswered."""
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    _, address = await leased(server, source, "ch", step("q", 1))
    first = None
    if token == "used":
        first = aiter(await SocketSteps.open(address))
        assert await anext(first) == step("q", 1)
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(address.token if token == "used" else bytes(TOKEN_BYTES))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # the end of the stream, and nothing before it
    writer.close()
    if first is None:
        assert "ch" not in source.ended  # its steps never started
    else:
        assert not source.ended["ch"].is_set()  # the first connection's channel goes on
        await first.aclose()


async def test_the_router_closing_the_socket_ends_the_channels_steps_and_the_lease():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    lease, address = await leased(server, source, "ch", step("q", 1))
    async for received in await SocketSteps.open(address):
        assert received == step("q", 1)
        break  # leaving the loop closes the socket
    await asyncio.wait_for(source.ended["ch"].wait(), 10)  # closing the steps is what aborts the requests left
    await asyncio.wait_for(lease.ended.wait(), 10)


async def test_the_end_of_a_lease_closes_the_socket_at_once_and_the_routers_steps_end():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    lease, address = await leased(server, source, "ch", step("q", 1))
    received = []
    async for item in await SocketSteps.open(address):
        received.append(item)
        server.release(lease)  # the router's lease ended: its Ray stream was cancelled or its router is gone
    assert received == [step("q", 1)]
    await asyncio.wait_for(source.ended["ch"].wait(), 10)


class LeaseStream:
    """Serve's streaming response for `outputs`: a hello, then (a socket offered) nothing until cancelled, or the
    steps."""

    def __init__(self, replica: "ScriptedReplica", channel: str, socket: bool) -> None:
        self.replica, self.channel, self.socket, self.cancelled = replica, channel, socket, asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self):
        address = await self.replica.address(self.channel) if self.socket else None
        yield StepChunks("r", address=address)
        if address is None:
            for item in self.replica.steps:
                yield item
        await self.cancelled.wait()


class ScriptedReplica:
    """Serve's handle to replica "r": its socket is `server` (or `address` as given, None: it offers none)."""

    def __init__(self, steps: list[StepChunks], server: OutputServer | None = None,
                 address: OutputAddress | None = None) -> None:
        self.steps, self.server, self.given, self.leases = steps, server, address, []

    async def address(self, channel: str) -> OutputAddress | None:
        return await self.server.address(self.server.lease(channel)) if self.server else self.given

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
            self.leases.append(LeaseStream(self, channel, socket))
            return self.leases[-1]
        return type("Call", (), {"remote": staticmethod(remote)})


def request(request_id: str) -> SubmitRequest:
    return SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2))


def last(request_id: str, token: int) -> StepChunks:
    return StepChunks("r", [Chunk("r", request_id, "x", [token], finish_reason="length", completion_tokens=2)])


async def test_the_router_reads_a_channel_over_the_socket_while_its_ray_stream_stays_open_as_the_lease():
    source = ScriptedSteps()
    server = OutputServer("127.0.0.1", source)
    handle = ScriptedReplica([], server)
    channels = ReplicaChannels(handle)
    source.queues[channels.channel_id] = queue = asyncio.Queue()
    queue.put_nowait(step("a", 1))
    queue.put_nowait(last("a", 2))
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]
    assert [c.token_ids for c in chunks] == [[1], [2]]
    (lease,) = handle.leases
    assert lease.socket and not lease.cancelled.is_set()  # the channel stays open for the replica's next requests
    channels.close("r", ConnectionError("closed by the test"))
    await asyncio.wait_for(source.ended[channels.channel_id].wait(), 10)  # the socket closed: the replica aborts
    await asyncio.wait_for(lease.cancelled.wait(), 10)


async def test_a_socket_the_router_cannot_reach_leaves_the_replicas_outputs_on_ray_streams():
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()  # nothing listens there any more
    handle = ScriptedReplica([step("a", 1), last("a", 2)], address=OutputAddress("127.0.0.1", port, b"t" * 32))
    channels = ReplicaChannels(handle)
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]
    assert [c.token_ids for c in chunks] == [[1], [2]]
    first, over_ray = handle.leases
    assert first.socket and first.cancelled.is_set() and not over_ray.socket
    channels.close("r", ConnectionError("closed by the test"))
    await asyncio.wait_for(over_ray.cancelled.wait(), 10)
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]  # over the replica's next channel
    assert [c.token_ids for c in chunks] == [[1], [2]]
    assert not handle.leases[-1].socket  # which asks for no socket: the replica's was unreachable


async def test_a_replica_that_offers_no_socket_sends_its_steps_on_the_ray_stream():
    handle = ScriptedReplica([step("a", 1), last("a", 2)])
    channels = ReplicaChannels(handle)
    chunks = [chunk async for chunk in channels.open(request("a"), "r")]
    assert [c.token_ids for c in chunks] == [[1], [2]]
    (lease,) = handle.leases  # the stream that asked for the socket carried the steps: no second one
    assert lease.socket
