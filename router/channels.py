"""Colocated requests over one output channel per replica.

A request is submitted with a short call (`EngineReplica.submit`); its chunks come back, with every
other request's on that replica, over one long-lived channel per replica (`EngineReplica.outputs`),
a step's worth per message, and are handed to each request's own queue here. One message a
step instead of one per running request: at 64 streams that was most of the CPU serving spent
beyond the forward pass, on hosts where the router, the proxy and the engine share a few cores.
The messages travel over the replica's output socket, a fraction of a Ray stream item's cost (at
batch 1 a message is a token), while the Ray stream that opened the channel stays open as its lease
(replicas/output_socket.py); over that stream itself where the socket cannot be reached.

To the dispatcher a request still looks like one replica's stream (`open(message, replica_id)`, an
async iterator of chunks with `cancel()`). A replica whose channel breaks fails every request on it
with `ReplicaGone` (or Ray's own error), which the dispatcher treats like a replica that died.
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import ray

from kvloom.replicas.messages import ActorName, Chunk, OutputAddress, StepChunks, SubmitRequest
from kvloom.replicas.output_socket import SocketSteps

logger = logging.getLogger(__name__)
LEASE_END_S = 2.0  # after the replica ended the socket, how long its lease may take to say why


SERVE_NAMESPACE = "serve"  # where Serve names its replicas' actors (not the namespace their runtime context shows)


def this_actor() -> ActorName | None:
    """This process's Serve replica actor (the router), if it is one."""
    if not ray.is_initialized():  # asking the runtime context would start a local Ray
        return None
    context = ray.get_runtime_context()
    name = context.get_actor_name() if context.get_actor_id() is not None else None
    return ActorName(name, SERVE_NAMESPACE) if name else None


class ReplicaGone(RuntimeError):
    """The replica's output channel ended or broke with requests still on it."""


class ReplicaLeft(ReplicaGone):
    """The router closed the channel of a replica Serve is stopping (router/membership.py)."""


class ReplicaChannels:
    resumable = True  # a request may go on on another replica from the tokens its client has

    def __init__(self, replicas_handle) -> None:
        self.handle = replicas_handle
        self.channel_id = uuid.uuid4().hex  # this router process's channel on every replica
        self.reader = this_actor()  # replicas end its channels once it is gone (a killed router's would stay open)
        self.requests: dict[str, "ChannelStream"] = {}
        self._listeners: dict[str, asyncio.Task] = {}
        self._closing: dict[str, ReplicaGone] = {}  # why the router closes a replica's channel
        self._unreachable: set[str] = set()  # replicas whose output socket could not be reached: Ray streams

    def open(self, message: SubmitRequest, replica_id: str) -> "ChannelStream":
        return ChannelStream(self, message, replica_id)

    def running_on(self, replica_id: str) -> int:
        """Requests submitted to the replica that have not finished."""
        return sum(r.replica_id == replica_id and not r.finished for r in self.requests.values())

    def close(self, replica_id: str, error: ReplicaGone) -> None:
        """Stop reading the replica's channel (which aborts what runs there); its requests end with `error`."""
        listener = self._listeners.get(replica_id)
        if listener is not None:
            self._closing[replica_id] = error
            listener.cancel()

    def close_all(self, error: ReplicaGone) -> None:
        """Stop reading every replica's channel (the router is stopping)."""
        for replica_id in list(self._listeners):
            self.close(replica_id, error)

    def listen(self, replica_id: str) -> None:
        """Make sure the replica's channel is being read (opened on the first request sent there)."""
        if replica_id not in self._listeners:
            self._listeners[replica_id] = asyncio.get_running_loop().create_task(self._listen(replica_id))

    async def _listen(self, replica_id: str) -> None:
        error: BaseException = ReplicaGone(f"replica {replica_id} closed its output channel")
        try:
            async for step in self._steps(replica_id):
                if step.replica != replica_id:  # Serve sent the call elsewhere: the target is gone
                    error = ReplicaGone(f"replica {replica_id} is gone")
                    break
                for chunk in step.chunks:
                    request = self.requests.get(chunk.request_id)
                    if request is not None:
                        request.queue.put_nowait(chunk)
        except Exception as exc:  # the replica died (RayActorError) or its channel broke
            error = exc
        finally:  # the steps closed the channel on their way out: the replica aborts what still runs on it
            del self._listeners[replica_id]
            error = self._closing.pop(replica_id, error)
            for request in list(self.requests.values()):
                if request.replica_id == replica_id and not request.finished:
                    request.queue.put_nowait(error)

    async def _steps(self, replica_id: str) -> AsyncIterator[StepChunks]:
        """The replica's channel: its first item (naming the replica that answered), then its steps over the
        replica's output socket (replicas/output_socket.py) while the Ray stream stays open as the channel's lease,
        or over the Ray stream itself where the replica offers no socket or it cannot be reached (a firewall between
        nodes: remembered for the replica). Raises what ended the lease (the replica's death) where it ended with
        the socket."""
        outputs = self.handle.options(stream=True).outputs
        socket = replica_id not in self._unreachable
        lease = outputs.remote(self.channel_id, target_replica=replica_id, caller=self.reader, socket=socket)
        try:
            items = aiter(lease)
            hello = await anext(items)
            yield hello
            if hello.replica != replica_id:
                return
            steps = await self._open_socket(replica_id, hello.address)
            if steps is None:  # no socket offered, or none reachable: the steps come over Ray
                if hello.address is not None:
                    lease.cancel()
                    lease = outputs.remote(self.channel_id, target_replica=replica_id, caller=self.reader)
                    items = aiter(lease)
                async for step in items:
                    yield step
                return
            ended = asyncio.ensure_future(anext(items, None))  # the lease has no items: this is its end
            ended.add_done_callback(lambda _: steps.close())
            try:
                async for step in steps:
                    yield step
                await asyncio.wait({ended}, timeout=LEASE_END_S)  # the socket ended first: why the lease ends
            finally:
                ended.cancel()
            if ended.done() and not ended.cancelled() and ended.exception() is not None:
                raise ended.exception()
        finally:
            lease.cancel()

    async def _open_socket(self, replica_id: str, address: OutputAddress | None) -> SocketSteps | None:
        if address is None:
            return None
        try:
            return await SocketSteps.open(address)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("replica %s: its output socket %s:%d cannot be reached (%r): its outputs come over Ray",
                           replica_id, address.host, address.port, exc)
            self._unreachable.add(replica_id)
            return None


class ChannelStream:
    """One request's chunks: the dispatcher iterates it and cancels it if it stops early."""

    def __init__(self, owner: ReplicaChannels, message: SubmitRequest, replica_id: str) -> None:
        self.owner = owner
        self.message = message
        self.request_id = message.request_id
        self.replica_id: str | None = None  # where it runs, once submitted
        self.target = replica_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def cancel(self) -> None:
        if self.replica_id is not None and not self.finished:
            self.finished = True
            self.owner.handle.abort.remote(self.request_id, target_replica=self.replica_id)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        owner = self.owner
        owner.requests[self.request_id] = self
        try:
            reply = await owner.handle.submit.remote(self.message, owner.channel_id, target_replica=self.target)
            if reply.error is not None:
                self.finished = True
                yield Chunk(reply.replica, self.request_id, error=reply.error)
                return
            self.replica_id = reply.replica
            owner.listen(self.replica_id)
            while not self.finished:
                chunk = await self.queue.get()
                if isinstance(chunk, BaseException):
                    self.finished = True  # nothing left to abort there
                    raise chunk
                self.finished = chunk.finished
                yield chunk
        finally:
            owner.requests.pop(self.request_id, None)
