"""The router's own logic without Ray: replica choice, credit, admission order and retry rules.

The transport is replaced by a scripted stand-in for Serve's handle; what is under test is the
router's decisions, not Serve.
"""

import asyncio
import itertools
from types import SimpleNamespace

import pytest
import ray.exceptions

from kvloom.engine.block_pool import prompt_block_hashes
from kvloom.engine.sampling import SamplingParams
from kvloom.replicas.messages import (Chunk, Continuation, ReplicaError, ReplicaStats, StepChunks, SubmitReply,
                                      SubmitRequest)
from kvloom.router.admission import AdmissionQueue, Ticket
from kvloom.router.channels import ReplicaChannels
from kvloom.router.dispatcher import Dispatcher, Job
from kvloom.router.errors import APIError
from kvloom.router.metrics import RouterMetrics
from kvloom.router.replica_table import ReplicaTable
from kvloom.router.responses import ReadAhead, start_choices


def stats(replica_id: str, max_num_seqs: int = 2, cached=(), healthy: bool = True) -> ReplicaStats:
    return ReplicaStats(replica_id, max_num_seqs=max_num_seqs, cached_prefix_hashes=list(cached), healthy=healthy)


def test_prefix_affinity_picks_the_replica_holding_the_prompt():
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0)
    table.report(stats("a"))
    table.report(stats("b", cached=prompt[:3]))
    assert table.choose(prompt).replica_id == "b"


def test_a_prompt_sent_to_a_replica_draws_its_group_there_until_a_report_shows_its_blocks():
    """A report the replica built before the prompt's blocks were cached does not make the router forget them."""
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0)
    for replica_id in ("a", "b"):
        table.report(stats(replica_id, max_num_seqs=4))
    table.take(table.replicas["b"], prompt)
    table.report(stats("b", max_num_seqs=4))  # built before the prompt ran
    table.give_back(table.replicas["b"])
    assert table.choose(prompt).replica_id == "b"


def test_imbalance_overrides_affinity():
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0, imbalance_threshold=1)
    table.report(stats("a", max_num_seqs=10))
    table.report(stats("b", max_num_seqs=10, cached=prompt))
    busy = table.replicas["b"]
    busy.inflight = 2
    assert table.choose(prompt).replica_id == "a"


def tiered(replica_id: str, node: str, cached=(), tier=(), max_num_seqs: int = 10) -> ReplicaStats:
    """A replica running KV tiers on `node`; `tier`: what it reports its node's tiers hold."""
    return ReplicaStats(replica_id, node_id=node, max_num_seqs=max_num_seqs, cached_prefix_hashes=list(cached),
                        tier_prefix_hashes=list(tier), kv_tiers={})


def test_a_busy_holder_sends_its_prompt_to_a_replica_loading_it_from_their_nodes_tier_not_to_one_computing_it():
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0, imbalance_threshold=1)
    table.report(tiered("holder", "n1", cached=prompt, tier=prompt))
    table.report(tiered("far", "n2"))  # first in line among the idle ones
    table.report(tiered("neighbour", "n1"))
    table.replicas["holder"].inflight = 2
    assert table.choose(prompt).replica_id == "neighbour"


def test_the_pools_holder_wins_over_its_nodes_tier_while_it_is_not_too_busy():
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0, imbalance_threshold=1)
    table.report(tiered("neighbour", "n1"))
    table.report(tiered("holder", "n1", cached=prompt, tier=prompt))
    table.replicas["holder"].inflight = 1
    assert table.choose(prompt).replica_id == "holder"


@pytest.mark.parametrize("tier_blocks, chosen", [(6, "tier"), (4, "pool")])
def test_a_block_in_the_nodes_tier_after_the_pools_run_counts_half_a_pool_block(tier_blocks, chosen):
    """pool: 3 blocks in its pool; tier: 1 in its pool, then tier_blocks - 1 more in its node's tier (3.5 or 2.5)."""
    prompt = prompt_block_hashes(list(range(128)), 16)
    table = ReplicaTable(slack=0)
    table.report(tiered("pool", "n1", cached=prompt[:3]))
    table.report(tiered("tier", "n2", cached=prompt[:1], tier=prompt[:tier_blocks]))
    assert table.choose(prompt).replica_id == chosen


def test_a_nodes_tier_reaches_nothing_for_a_replica_without_tiers_nor_for_another_nodes_replica():
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0)
    table.report(tiered("writer", "n1", tier=prompt, max_num_seqs=1))
    table.report(ReplicaStats("plain", node_id="n1", max_num_seqs=10))  # no KV tiers
    table.report(tiered("far", "n2"))
    table.report(ReplicaStats("idle", node_id="n3", max_num_seqs=10))
    for busy in ("writer", "plain", "far"):  # the writer has no credit left then; the others reach nothing
        table.take(table.replicas[busy], [])
    assert table.choose(prompt).replica_id == "idle"


def test_a_prompt_sent_to_a_replica_with_tiers_is_in_its_nodes_tier_before_a_report_shows_it():
    """It writes the blocks through as it computes them; a report built before that does not wipe them."""
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0, imbalance_threshold=0)
    for replica_id, node in (("holder", "n1"), ("far", "n2"), ("neighbour", "n1")):
        table.report(tiered(replica_id, node))
    table.take(table.replicas["holder"], prompt)
    assert table.choose(prompt).replica_id == "neighbour"
    table.report(tiered("holder", "n1"))  # built before the prompt ran
    assert table.choose(prompt).replica_id == "neighbour"


def test_when_the_longest_holder_is_too_busy_a_shorter_one_within_the_threshold_wins_over_the_least_loaded():
    prompt = prompt_block_hashes(list(range(64)), 16)
    table = ReplicaTable(slack=0, imbalance_threshold=1)
    table.report(stats("idle", max_num_seqs=10))
    table.report(stats("longest", max_num_seqs=10, cached=prompt))
    table.report(stats("shorter", max_num_seqs=10, cached=prompt[:2]))
    table.replicas["longest"].inflight = 2
    table.replicas["shorter"].inflight = 1
    assert table.choose(prompt).replica_id == "shorter"


def test_least_loaded_without_affinity_and_no_credit_means_none():
    table = ReplicaTable(slack=0)
    table.report(stats("a", max_num_seqs=1))
    table.report(stats("b", max_num_seqs=1))
    first = table.choose([])
    table.take(first, [])
    second = table.choose([])
    assert second.replica_id != first.replica_id
    table.take(second, [])
    assert table.choose([]) is None


def test_unhealthy_or_silent_replicas_are_dropped():
    table = ReplicaTable(stale_after_s=0.0)
    table.report(stats("a"))
    table.report(stats("b", healthy=False))
    assert "b" not in table.replicas
    assert table.live() == []  # a has gone silent for longer than stale_after_s


async def test_admission_dispatches_in_arrival_order_as_credit_frees():
    table = ReplicaTable(slack=0)
    table.report(stats("a", max_num_seqs=1))
    queue = AdmissionQueue(table, max_queued=10)
    order = []

    async def request(name):
        replica = await queue.acquire(Ticket(name, []))
        order.append(name)
        await asyncio.sleep(0.01)
        queue.release(replica)

    await asyncio.gather(*(request(f"r{i}") for i in range(5)))
    assert order == [f"r{i}" for i in range(5)]
    assert table.replicas["a"].inflight == 0


async def test_full_router_queue_is_503():
    table = ReplicaTable(slack=0)  # no replicas: everything queues
    queue = AdmissionQueue(table, max_queued=1)
    waiting = asyncio.create_task(queue.acquire(Ticket("first", [])))
    await asyncio.sleep(0)
    with pytest.raises(APIError) as err:
        await queue.acquire(Ticket("second", []))
    assert err.value.status == 503
    waiting.cancel()


class ScriptedResponse:
    def __init__(self, chunks, fail_after: int | None):
        self.chunks, self.fail_after, self.cancelled = chunks, fail_after, False

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        for i, chunk in enumerate(self.chunks):
            if self.fail_after == i:
                raise ray.exceptions.RayActorError()
            yield chunk
        if self.fail_after == len(self.chunks):
            raise ray.exceptions.RayActorError()


class ScriptedStreams:
    """Stands in for the replica channels: per replica, a scripted stream; records what each was sent."""

    def __init__(self, scripts, resumable: bool):
        self.scripts, self.resumable, self.calls, self.messages = scripts, resumable, [], []

    def open(self, message, replica_id):
        self.calls.append(replica_id)
        self.messages.append(message)
        return self.scripts[replica_id]()


def chunk(tokens, finish=None, text="t", done=None):
    return Chunk("x", "r", text, tokens, None, finish, prompt_tokens=3, completion_tokens=done or len(tokens))


def job(request_id: str, fork_of: str | None = None) -> Job:
    return Job(SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                             fork_of=fork_of), [])


def make_dispatcher(scripts, resumable: bool = True, **options):
    """Replicas named by `scripts`, chosen in that order."""
    table = ReplicaTable(slack=0)
    for order, name in enumerate(scripts):
        table.report(stats(name, max_num_seqs=1))
        table.replicas[name].dispatched = order
    streams = ScriptedStreams(scripts, resumable)
    return Dispatcher(streams, AdmissionQueue(table, 10), RouterMetrics(table), **options), streams, table


async def test_request_that_streamed_nothing_is_retried_on_another_replica():
    dispatcher, handle, table = make_dispatcher({
        "a": lambda: ScriptedResponse([chunk([1])], fail_after=0),
        "b": lambda: ScriptedResponse([chunk([1]), chunk([2], "length")], fail_after=None),
    })
    got = [c async for c in dispatcher.run(job("r"))]
    assert handle.calls == ["a", "b"] and handle.messages[1].continuation is None
    assert [c.token_ids for c in got] == [[1], [2]]
    assert "a" not in table.replicas and table.replicas["b"].inflight == 0


async def test_a_stream_whose_replica_dies_goes_on_elsewhere_from_what_the_client_has():
    dispatcher, handle, table = make_dispatcher({
        "a": lambda: ScriptedResponse([chunk([1], text="Hel"), chunk([2], text="lo")], fail_after=2),
        "b": lambda: ScriptedResponse([chunk([3], "length", text=" you", done=3)], fail_after=None),
    })
    moved = job("r")
    got = [c async for c in dispatcher.run(moved)]
    assert handle.calls == ["a", "b"]
    assert [c.token_ids for c in got] == [[1], [2], [3]] and "".join(c.text for c in got) == "Hello you"
    assert handle.messages[1].continuation == Continuation(output_token_ids=[1, 2], emitted_chars=5)
    assert handle.messages[1].request_id == "r" and handle.messages[1].prompt_token_ids == [1, 2, 3]
    assert dispatcher.metrics.moved.labels(moved.tenant.name, "continued")._value.get() == 1
    usage = moved.tenant.usage  # the prompt once, each token once
    assert (usage.prompt_tokens, usage.completion_tokens, usage.requests) == (3, 3, 1)
    assert "a" not in table.replicas and table.replicas["b"].inflight == 0


async def test_a_stream_that_cannot_go_on_ends_with_a_clear_error():
    dispatcher, handle, _ = make_dispatcher({  # a disaggregated stream, once handed off
        "a": lambda: ScriptedResponse([chunk([1]), chunk([2])], fail_after=1),
        "b": lambda: ScriptedResponse([chunk([9], "length")], fail_after=None),
    }, resumable=False)
    received = []
    with pytest.raises(APIError) as err:
        async for c in dispatcher.run(job("r")):
            received.append(c)
    assert err.value.status == 500 and "mid-stream" in err.value.message
    assert handle.calls == ["a"] and len(received) == 1


async def test_moves_are_bounded_by_max_retries_and_retry_wait_s():
    failing = {name: (lambda: ScriptedResponse([chunk([1])], fail_after=1)) for name in "abc"}
    dispatcher, handle, _ = make_dispatcher(failing, max_retries=1)
    with pytest.raises(APIError) as err:
        _ = [c async for c in dispatcher.run(job("r"))]
    assert handle.calls == ["a", "b"] and "each of 2 attempts" in err.value.message

    dispatcher, handle, _ = make_dispatcher({"a": failing["a"]}, retry_wait_s=0.05)  # no replica to go on on
    with pytest.raises(APIError) as err:
        _ = [c async for c in dispatcher.run(job("r"))]
    assert err.value.status == 503 and "within 0.05 s" in err.value.message


async def test_a_choice_read_ahead_frees_its_slot_for_the_next_choice_of_its_request():
    """One slot, two choices: the first one's stream is read on while the second waits for the slot."""
    replies = {"a": lambda: ScriptedResponse([chunk([1]), chunk([2], finish="length", done=2)], fail_after=None)}
    dispatcher, _, _ = make_dispatcher(replies)
    first = dispatcher.run(job("first"))
    assert (await anext(first)).token_ids == [1]
    second = dispatcher.run(job("second", fork_of="first"))
    second_chunk = asyncio.ensure_future(anext(second))
    await asyncio.sleep(0.2)
    assert not second_chunk.done()  # unread, the first choice holds the only slot
    ahead = ReadAhead(first)
    assert (await asyncio.wait_for(second_chunk, 5)).token_ids == [1]
    assert [c.token_ids async for c in ahead] == [[2]]
    await second.aclose()


async def test_read_ahead_passes_errors_on_and_closing_it_stops_the_stream():
    dispatcher, _, _ = make_dispatcher({"a": lambda: ScriptedResponse([chunk([1])], fail_after=1)}, resumable=False,
                                       max_retries=0)
    failing = ReadAhead(dispatcher.run(job("r")))
    assert (await anext(failing)).token_ids == [1]
    with pytest.raises(APIError):
        await anext(failing)

    endless = ScriptedResponse((chunk([i]) for i in itertools.count()), fail_after=None)
    dispatcher, _, table = make_dispatcher({"a": lambda: endless})
    ahead = ReadAhead(dispatcher.run(job("r")))
    assert (await anext(ahead)).token_ids == [0]
    await ahead.aclose()
    assert endless.cancelled and dispatcher.active == 0 and table.replicas["a"].inflight == 0


def choice_jobs(prompts: int, n: int) -> list[Job]:
    """Job `p{i}c{j}` is prompt i's choice j; later choices fork the first, as the router sends them."""
    return [job(f"p{i}c{j}", f"p{i}c0" if j else None) for i in range(prompts) for j in range(n)]


async def test_a_requests_prompts_start_together_and_a_prompts_choices_in_turn():
    """Three prompts, two choices each: every prompt's first choice is sent before any first token comes back
    (their prefills share engine steps); a prompt's second choice only once its first one has a token."""
    sent, first_token = [], {}

    async def start(job):
        sent.append(job.request_id)
        await first_token.setdefault(job.request_id, asyncio.Event()).wait()
        return chunk([1]), ScriptedResponse([chunk([2], "length")], fail_after=None).__aiter__()

    starting = asyncio.ensure_future(start_choices(choice_jobs(3, 2), 2, start))
    await asyncio.sleep(0.05)
    assert sent == ["p0c0", "p1c0", "p2c0"]
    first_token["p1c0"].set()
    await asyncio.sleep(0.05)
    assert sent[3:] == ["p1c1"]
    for prompt in (0, 2):
        first_token[f"p{prompt}c0"].set()
    await asyncio.sleep(0.05)
    for event in first_token.values():
        event.set()
    choices = await asyncio.wait_for(starting, 5)
    assert [(c.index, c.shares_prompt) for c in choices] == [(i, bool(i % 2)) for i in range(6)]
    streamed = []  # one comprehension a choice: Python 3.10 has no async comprehension inside a sync one
    for choice in choices:
        streamed.append([c.token_ids async for c in choice.stream])
    assert streamed == [[[2]]] * 6


async def test_a_prompt_that_fails_to_start_fails_the_request_and_closes_every_started_choice():
    closed = []

    async def start(job):
        if job.request_id == "p1c0":
            raise APIError(400, "token id 99999 outside the vocabulary", "prompt")

        async def endless():
            try:
                while True:
                    yield chunk([1])
                    await asyncio.sleep(0.01)
            finally:
                closed.append(job.request_id)
        return chunk([1]), endless()

    with pytest.raises(APIError, match="outside the vocabulary"):
        await start_choices(choice_jobs(3, 1), 1, start)
    assert sorted(closed) == ["p0c0", "p2c0"]


def scripted_replica_handle(items):
    """Serve's handle to the replicas, scripted: replica "a" takes any request; its channel streams `items`."""
    submitted = []

    async def submit(message, channel, target_replica=None):
        submitted.append(message.request_id)
        return SubmitReply("a")

    async def outputs(channel, target_replica=None, caller=None, socket=False):
        for item in items(submitted[-1]):
            yield item
            await asyncio.sleep(0)

    handle = SimpleNamespace(submit=SimpleNamespace(remote=submit), outputs=SimpleNamespace(remote=outputs),
                             abort=SimpleNamespace(remote=lambda request_id, target_replica: None))
    handle.options = lambda stream: handle
    return handle


async def test_an_error_chunk_on_the_output_channel_ends_the_request_with_it():
    """A request the engine refused once queued (not at submit) comes back as one error chunk, without the
    fields of a token chunk."""
    refused = Chunk("a", "r1", error=ReplicaError("refused", "seed"))
    handle = scripted_replica_handle(lambda rid: [StepChunks("a"), StepChunks("a", [refused])])
    stream = ReplicaChannels(handle).open(job("r1").message, "a")
    assert [chunk async for chunk in stream] == [refused]


def test_metrics_show_each_replicas_kv_tiers():
    table = ReplicaTable(slack=0)
    tier = {"hits": 5, "misses": 2, "blocks_written": 9, "bytes_read": 4096, "load_s": 0.25, "used_bytes": 8192}
    table.report(ReplicaStats("a", kv_tiers={"restore_s": 0.1, "host": tier, "disk": {**tier, "hits": 1}}))
    table.report(stats("b"))  # no tiers: no series
    text = RouterMetrics(table).render().decode()
    assert 'kvloom:kv_tier_hits_total{replica="a",tier="host"} 5.0' in text
    assert 'kvloom:kv_tier_hits_total{replica="a",tier="disk"} 1.0' in text
    assert 'kvloom:kv_tier_used_bytes{replica="a",tier="host"} 8192.0' in text
    assert 'replica="b",tier=' not in text
