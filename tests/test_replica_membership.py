"""The router's side of replicas that come and go, without Ray: a replica takes requests once Serve routes to
it; one Serve stops gets no new request, its running requests finish within the grace period or move on to
another replica from what the client has; a request that finds no replica asks Serve for one and waits, at
most the cold-start timeout; the router logs replicas coming and going with the load signals at each change.

Serve's handle to the replicas is scripted (the test feeds each replica's output channel); the router's
channels, dispatcher, admission queue and table are the real ones. `test_autoscaling.py` does it under Serve.
"""

import asyncio
from types import SimpleNamespace

import pytest

from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.messages import Chunk, Continuation, ReplicaStats, StepChunks, SubmitReply, SubmitRequest
from kvloom.router.admission import AdmissionQueue, Ticket
from kvloom.router.channels import ReplicaChannels
from kvloom.router.cold_start import ColdStart
from kvloom.router.dispatcher import Dispatcher, Job
from kvloom.router.errors import APIError
from kvloom.router.metrics import RouterMetrics
from kvloom.router.replica_table import ReplicaState, ReplicaTable
from kvloom.router.serving_replicas import SERVING
from kvloom.router.membership import ReplicaMembership
from kvloom.router.scaling_log import ScalingLog


class ChannelStream:
    """One replica's output channel as Serve's streaming response: what the test feeds, after the replica's
    name; `cancel()` as Serve's."""

    def __init__(self, replica: str, feed: asyncio.Queue) -> None:
        self.replica, self.feed, self.cancelled = replica, feed, False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        yield StepChunks(self.replica)
        while True:
            yield StepChunks(self.replica, [await self.feed.get()])


class ScriptedReplicas:
    """Serve's handle to replicas "a" and "b": each takes what is sent to it; the test feeds their channels."""

    def __init__(self) -> None:
        self.feeds = {name: asyncio.Queue() for name in "ab"}
        self.channels: dict[str, ChannelStream] = {}
        self.submitted: list[tuple[str, SubmitRequest]] = []
        self.arrived = {name: asyncio.Event() for name in "ab"}
        self.submit = SimpleNamespace(remote=self._submit)
        self.outputs = SimpleNamespace(remote=self._outputs)
        self.abort = SimpleNamespace(remote=lambda request_id, target_replica: None)

    def options(self, **options) -> "ScriptedReplicas":
        return self

    async def _submit(self, message: SubmitRequest, channel: str, target_replica: str) -> SubmitReply:
        self.submitted.append((target_replica, message))
        self.arrived[target_replica].set()
        return SubmitReply(target_replica)

    def _outputs(self, channel: str, target_replica: str, caller=None, socket=False) -> ChannelStream:
        self.channels[target_replica] = ChannelStream(target_replica, self.feeds[target_replica])
        return self.channels[target_replica]


def tokens(replica: str, ids: list[int], text: str, finish: str | None = None, done: int = 0) -> Chunk:
    return Chunk(replica, "r", text, ids, None, finish, prompt_tokens=3, completion_tokens=done or len(ids))


def cluster(grace_s: float):
    """Replicas "a" (chosen first) and "b" in Serve's set and the router's table."""
    table = ReplicaTable(slack=0)
    for order, name in enumerate("ab"):
        table.report(ReplicaStats(name, max_num_seqs=4))
        table.replicas[name].dispatched = order
    replicas = ScriptedReplicas()
    channels = ReplicaChannels(replicas)
    dispatcher = Dispatcher(channels, AdmissionQueue(table, 10), RouterMetrics(table))
    SERVING.publish("Replicas", frozenset("ab"))
    membership = ReplicaMembership("Replicas", table, channels, grace_s)
    membership.check()
    return table, replicas, dispatcher, membership


async def read_all(dispatcher: Dispatcher) -> list[Chunk]:
    job = Job(SubmitRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=SamplingParams()), [])
    return [chunk async for chunk in dispatcher.run(job)]


async def test_a_replica_serve_stops_takes_no_new_request_and_its_streams_move_on_after_the_grace_period():
    table, replicas, dispatcher, membership = cluster(grace_s=0.05)
    client = asyncio.create_task(read_all(dispatcher))
    await replicas.arrived["a"].wait()
    replicas.feeds["a"].put_nowait(tokens("a", [7], "Hel"))

    SERVING.publish("Replicas", frozenset("b"))  # Serve chose "a" for removal
    membership.check()
    assert "a" not in table.replicas and table.choose([]).replica_id == "b"
    table.report(ReplicaStats("a", max_num_seqs=4))  # its last stats pushes do not bring it back
    assert "a" not in table.replicas

    await asyncio.wait_for(replicas.arrived["b"].wait(), 5)  # the grace period passed, the stream unfinished: it moved
    replicas.feeds["b"].put_nowait(tokens("b", [8], "lo", finish="length", done=2))
    got = await asyncio.wait_for(client, 5)
    where, moved = replicas.submitted[-1]
    assert where == "b" and moved.continuation == Continuation(output_token_ids=[7], emitted_chars=3)
    assert [c.token_ids for c in got] == [[7], [8]] and "".join(c.text for c in got) == "Hello"
    assert replicas.channels["a"].cancelled  # closing the channel aborts what is left there
    assert table.replicas["b"].inflight == 0 and not membership.leaving


async def test_a_stream_that_finishes_within_the_grace_period_stays_where_it_is():
    table, replicas, dispatcher, membership = cluster(grace_s=30)
    client = asyncio.create_task(read_all(dispatcher))
    await replicas.arrived["a"].wait()
    SERVING.publish("Replicas", frozenset("b"))
    membership.check()
    replicas.feeds["a"].put_nowait(tokens("a", [7, 8], "Hello", finish="stop"))
    got = await client
    assert [c.token_ids for c in got] == [[7, 8]] and [w for w, _ in replicas.submitted] == ["a"]
    await asyncio.wait_for(asyncio.gather(*membership.leaving.values()), 5)  # the channel closes at once
    assert replicas.channels["a"].cancelled


async def test_a_replica_that_reports_before_serve_routes_to_it_takes_no_request_until_serve_does():
    table, replicas, dispatcher, membership = cluster(grace_s=0.05)
    table.report(ReplicaStats("c", max_num_seqs=4))  # still starting: Serve would send its requests elsewhere
    table.replicas["c"].dispatched = -1  # the first choice, were it routable
    membership.check()
    assert "c" in table.replicas and not membership.leaving
    assert table.choose([]).replica_id == "a" and "c" not in {r.replica_id for r in table.routable()}
    SERVING.publish("Replicas", frozenset("abc"))
    membership.check()
    assert table.choose([]).replica_id == "c"


class ReadyCall:
    """Serve's handle to the replicas, for the cold start: `replica_ready.remote()` waits until cancelled."""

    def __init__(self) -> None:
        self.calls, self.cancelled = 0, 0
        self.replica_ready = SimpleNamespace(remote=self._remote)

    def _remote(self):
        self.calls += 1
        return SimpleNamespace(cancel=self._cancel)

    def _cancel(self):
        self.cancelled += 1


async def test_a_request_that_finds_no_replica_asks_serve_for_one_and_is_served_when_it_reports_in():
    table, handle, started = ReplicaTable(slack=0), ReadyCall(), []
    admission = AdmissionQueue(table, 10)
    cold_start = ColdStart(handle, table, admission, timeout_s=60, observe=started.append)
    cold_start.notice()
    cold_start.notice()  # one call waits for all
    waiting = asyncio.create_task(admission.acquire(Ticket("first", [])))
    await asyncio.sleep(0)
    cold_starting = cold_start.waiting
    assert handle.calls == 1 and cold_starting is not None and not waiting.done()

    table.report(ReplicaStats("a", max_num_seqs=4))
    cold_start.replica_reported()  # as the router does with each report, before it pumps the queue
    assert len(started) == 1 and cold_start.waiting is None  # recorded before any request reaches the replica
    admission.pump()
    assert (await waiting).replica_id == "a"
    await asyncio.gather(cold_starting, return_exceptions=True)
    assert cold_starting.cancelled() and handle.cancelled == 1
    cold_start.replica_reported()  # later reports end nothing
    assert len(started) == 1


async def test_a_request_waits_for_a_cold_start_at_most_the_timeout_then_gets_503_with_retry_after():
    table, handle = ReplicaTable(slack=0), ReadyCall()
    admission = AdmissionQueue(table, 10)
    cold_start = ColdStart(handle, table, admission, timeout_s=0.2)
    cold_start.notice()
    with pytest.raises(APIError) as refused:
        await asyncio.wait_for(admission.acquire(Ticket("first", [])), 5)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"]
    assert "no replica was ready within 0.2 s" in refused.value.message


def test_the_scaling_log_records_each_replica_that_joins_or_leaves_with_the_signals_before_the_change():
    def replica(name: str, running: int, waiting: int, kv: float) -> ReplicaState:
        return ReplicaState(name, ReplicaStats(name, num_running=running, num_waiting=waiting, kv_cache_usage=kv), 0)

    log = ScalingLog()
    log.observe([replica("a", 0, 0, 0.0)], queued=0, ttft_p90_s=0.0)
    log.observe([replica("a", 2, 1, 0.4)], queued=0, ttft_p90_s=0.0)  # no change: no event
    log.observe([replica("a", 2, 1, 0.4), replica("b", 0, 0, 0.0)], queued=5, ttft_p90_s=3.5)
    log.observe([replica("a", 1, 0, 0.1)], queued=0, ttft_p90_s=0.2)
    events = log.as_dicts()
    assert [(e["replicas"], e["joined"], e["left"]) for e in events] == [(1, ["a"], []), (2, ["b"], []),
                                                                          (1, [], ["b"])]
    grew = events[1]
    assert (grew["waiting_per_replica"], grew["running"], grew["kv_usage"], grew["ttft_p90_s"]) == (6, 2, 0.4, 3.5)


def test_a_replica_of_an_earlier_deployment_pushing_to_the_new_router_is_not_counted():
    """A redeployment starts a new router while Serve still stops the earlier replicas, whose stats pushes may reach
    it: the router follows its own deployment's replicas only."""
    table = ReplicaTable(slack=0, deployment_id="new")
    table.report(ReplicaStats("old", max_num_seqs=4, deployment_id="earlier"))
    table.report(ReplicaStats("a", max_num_seqs=4, deployment_id="new"))
    assert [r.replica_id for r in table.live()] == ["a"]
