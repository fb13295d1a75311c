"""A replica's output channels over TCP: the same `StepChunks` as the Ray stream, without Ray's cost per item.

One output-channel item, a Ray stream item through Serve's handle, costs ~0.55-0.75 ms of CPU on each side on the
2-core hosts kvloom is measured on, and at batch 1 every engine step is one item; a frame on a socket ~0.1 ms
(docs/performance.md, session 55). So a replica also serves its channels on a TCP port of its node. The router still
opens each channel as a Ray stream (`EngineReplica.outputs(..., socket=True)`): its first item names the replica
and carries this socket's address and a token for this one channel, and the stream then stays open, item-less, as
the channel's lease: Serve counts it as the replica's ongoing call (a stopping replica waits for it,
router/membership.py), and either side ending it ends the channel. The router connects and sends the token; a token
opens one connection, once, and the replica sends nothing to a connection before its token matches. Frames are a
4-byte length and a pickle, as Ray's own messages are, and like them in clear: where Ray runs with TLS the replica
offers no socket and the steps stay on Ray.

The socket carries the steps: the router closing it, or the lease's end, ends the channel, which aborts the
requests still on it; the replica's end, or death, reaches the router as the end of the stream.
"""

import asyncio
import contextlib
import logging
import os
import pickle
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvloom.replicas.messages import OutputAddress, StepChunks

logger = logging.getLogger(__name__)
FRAME = struct.Struct("!I")  # a frame's length, then its bytes
TOKEN_BYTES = 32
HELLO_TIMEOUT_S = 2.0  # for a connection to present its token
MAX_UNAUTHENTICATED = 64  # connections waiting to present one; more are closed at once
CONNECT_TIMEOUT_S = 2.0
KEEPALIVE_S = 10  # a peer gone without a word (its node lost) is found within ~KEEPALIVE_S * 2

StepSource = Callable[[str], AsyncIterator[StepChunks]]  # a channel's steps; closing it aborts what is left


def ray_uses_tls() -> bool:
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """A connection whose peer's node is lost ends within seconds, not TCP's ~15 minutes."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_S), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", KEEPALIVE_S),
                          ("TCP_USER_TIMEOUT", 2 * KEEPALIVE_S * 1000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


@dataclass(eq=False)
class Lease:
    """One channel's right to one connection, for as long as its Ray stream is open."""

    channel: str
    token: bytes = field(default_factory=lambda: secrets.token_bytes(TOKEN_BYTES))
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once its connection has ended
    writer: asyncio.StreamWriter | None = None
    pump: asyncio.Task | None = None


class OutputServer:
    """A replica's side: started on first use, on `host` (its node's address), a port the OS picks."""

    def __init__(self, host: str, steps: StepSource) -> None:
        self.host, self.steps = host, steps
        self.starting: asyncio.Future | None = None  # the listening server, or why it cannot listen
        self.waiting: dict[bytes, Lease] = {}  # leases whose connection has not come yet, by token
        self.unauthenticated = 0

    async def address(self, lease: Lease) -> OutputAddress:
        """Where `lease`'s channel connects; raises OSError where this replica cannot listen."""
        if self.starting is None:
            self.starting = asyncio.ensure_future(asyncio.start_server(self._serve, self.host, 0))
        server = await asyncio.shield(self.starting)
        return OutputAddress(self.host, server.sockets[0].getsockname()[1], lease.token)

    def lease(self, channel: str) -> Lease:
        lease = Lease(channel)
        self.waiting[lease.token] = lease
        return lease

    def release(self, lease: Lease) -> None:
        """The lease ended: its connection goes at once, unsent frames and all; its steps end, aborting what still
        runs on the channel."""
        self.waiting.pop(lease.token, None)
        if lease.pump is not None:
            lease.pump.cancel()
        if lease.writer is not None:
            lease.writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease = None
        try:
            if self.unauthenticated >= MAX_UNAUTHENTICATED:
                return
            self.unauthenticated += 1
            try:
                token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HELLO_TIMEOUT_S)
            finally:
                self.unauthenticated -= 1
            lease = self.waiting.pop(token, None)  # one connection a lease
            if lease is None:
                logger.debug("output socket: a connection from %s without a live token was closed",
                             writer.get_extra_info("peername"))
                return
            keep_alive(writer)
            lease.writer, lease.pump = writer, asyncio.ensure_future(self._pump(writer, lease.channel))
            closed = asyncio.ensure_future(reader.read(1))  # the router sends nothing more: any return is its end
            await asyncio.wait({lease.pump, closed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (lease.pump, closed):
                task.cancel()
            for result in await asyncio.gather(lease.pump, closed, return_exceptions=True):
                if isinstance(result, Exception) and not isinstance(result, ConnectionError):
                    logger.warning("output socket: channel %s ended on %r", lease.channel, result)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.debug("output socket: a connection ended: %r", exc)
        finally:
            writer.close()
            if lease is not None:
                lease.ended.set()

    async def _pump(self, writer: asyncio.StreamWriter, channel: str) -> None:
        async with contextlib.aclosing(self.steps(channel)) as steps:  # closed, and so aborted, however this ends
            async for step in steps:
                data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
                writer.write(FRAME.pack(len(data)) + data)
                await writer.drain()


class SocketSteps:
    """The router's side of one channel: iterate it for the steps until the replica ends it; `close` ends it from
    here (the replica then aborts what runs on it), a pending read included."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, address: OutputAddress) -> "SocketSteps":
        """Raises OSError (or TimeoutError) where the address cannot be reached."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port),
                                                CONNECT_TIMEOUT_S)
        keep_alive(writer)
        writer.write(address.token)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.transport.abort()

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
