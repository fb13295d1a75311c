"""A replica's output channels over TCP: the same `StepChunks` as the Ray stream, without Ray's cost per item.

One output-channel item, a Ray stream item through Serve's handle, costs ~0.55-0.75 ms of CPU on each side on the
2-core hosts kvloom is measured on, and at batch 1 every engine step is one item; a frame on a socket ~0.1 ms
(docs/performance.md, session 55). So a replica also serves its channels on a TCP port of its node. The router still
opens each channel as a Ray stream (`EngineReplica.outputs(..., socket=True)`): its first item names the replica
and carries this socket's address and secret, and the stream then stays open, item-less, as the channel's lease:
Serve counts it as the replica's ongoing call (a stopping replica waits for it, router/membership.py), and either
side ending it ends the channel. The router connects and sends the secret with the channel's name; the replica
sends nothing before both match a leased channel. Frames are a 4-byte length and a pickle, as Ray's own messages
are: the router reads only from the address Ray gave it.

The socket carries the steps: the router closing it (or the lease's end closing it) ends the channel, which aborts
the requests still on it, and the replica's end, or death, reaches the router as the end of the stream.
"""

import asyncio
import hmac
import json
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncIterator, Callable

from kvloom.replicas.messages import OutputAddress, StepChunks

logger = logging.getLogger(__name__)
FRAME = struct.Struct("!I")  # a frame's length, then its bytes
SECRET_BYTES = 32
HELLO_LIMIT = 4096  # the channel's name, as JSON
HELLO_TIMEOUT_S = 10.0  # for a connection to say which channel it reads
CONNECT_TIMEOUT_S = 5.0

StepSource = Callable[[str], AsyncIterator[StepChunks]]  # a channel's steps; closing it aborts what is left


class OutputServer:
    """A replica's side: started on first use, on `host` (its node's address), a port the OS picks."""

    def __init__(self, host: str, steps: StepSource) -> None:
        self.host, self.steps = host, steps
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.server: asyncio.Server | None = None
        self.leases: dict[str, asyncio.Event] = {}  # leased channels: set once the channel's connection ended
        self.connections: dict[str, asyncio.StreamWriter] = {}

    async def address(self) -> OutputAddress:
        if self.server is None:
            self.server = await asyncio.start_server(self._serve, self.host, 0)
        return OutputAddress(self.host, self.server.sockets[0].getsockname()[1], self.secret)

    def lease(self, channel: str) -> asyncio.Event:
        """Let `channel` connect; the event is set once its connection has ended."""
        self.leases[channel] = asyncio.Event()
        return self.leases[channel]

    def release(self, channel: str) -> None:
        """The lease ended: close the channel's connection (its steps end, aborting what still runs)."""
        self.leases.pop(channel, None)
        writer = self.connections.pop(channel, None)
        if writer is not None:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = None
        try:
            hello = await asyncio.wait_for(read_hello(reader), HELLO_TIMEOUT_S)
            if hello is None or not hmac.compare_digest(hello[0], self.secret) or hello[1] not in self.leases:
                logger.warning("output socket: a connection from %s without a leased channel's secret was closed",
                               writer.get_extra_info("peername"))
                return
            channel = hello[1]
            self.connections[channel] = writer
            pump = asyncio.ensure_future(self._pump(writer, channel))
            closed = asyncio.ensure_future(reader.read(1))  # the router sends nothing more: any return is its end
            await asyncio.wait({pump, closed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (pump, closed):
                task.cancel()
            await asyncio.gather(pump, closed, return_exceptions=True)  # the steps' end aborts what is left
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.debug("output socket: a connection ended: %r", exc)
        finally:
            writer.close()
            if channel is not None and self.connections.get(channel) is writer:
                del self.connections[channel]
                if channel in self.leases:
                    self.leases[channel].set()

    async def _pump(self, writer: asyncio.StreamWriter, channel: str) -> None:
        async for step in self.steps(channel):
            data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
            writer.write(FRAME.pack(len(data)) + data)
            await writer.drain()


async def read_hello(reader: asyncio.StreamReader) -> tuple[bytes, str] | None:
    """(secret, channel) as a connection opens, or None for a malformed hello."""
    secret = await reader.readexactly(SECRET_BYTES)
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if size > HELLO_LIMIT:
        return None
    try:
        return secret, str(json.loads(await reader.readexactly(size))["channel"])
    except (ValueError, KeyError, TypeError):
        return None


class SocketSteps:
    """The router's side of one channel: iterate it for the steps until the replica ends it; `close` ends it from
    here (the replica then aborts what runs on it), a pending read included."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, address: OutputAddress, channel: str) -> "SocketSteps":
        """Raises OSError (or TimeoutError) where the address cannot be reached."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port),
                                                CONNECT_TIMEOUT_S)
        body = json.dumps({"channel": channel}).encode()
        writer.write(address.secret + FRAME.pack(len(body)) + body)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.close()

    async def __aiter__(self) -> AsyncIterator[StepChunks]:
        try:
            while True:
                try:
                    (size,) = FRAME.unpack(await self.reader.readexactly(FRAME.size))
                    data = await self.reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError):  # ended by the replica, its death, or close()
                    return
                yield pickle.loads(data)
        finally:
            self.close()
