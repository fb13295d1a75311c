"""A replica makes a request that may read an adapter from disk off its event loop (off_loop_preparation.py)."""

import asyncio
import threading

import pytest

from kvloom.engine.errors import InvalidRequestError
from kvloom.replicas.off_loop_preparation import OffLoopPreparation


def test_the_loop_runs_on_while_a_request_is_made_and_an_abort_meanwhile_drops_it():
    async def scenario():
        preparing = OffLoopPreparation()
        started, loop_free, release = threading.Event(), threading.Event(), threading.Event()

        def slow_read():  # returns only once the loop ran code while this read was still going
            started.set()
            made = "request" if loop_free.wait(5) else "the loop was blocked"
            release.wait(5)
            return made

        kept = asyncio.create_task(preparing.prepare("kept", slow_read))
        await asyncio.to_thread(started.wait, 5)
        loop_free.set()
        release.set()
        assert await kept == "request"

        started.clear()
        release.clear()
        dropped = asyncio.create_task(preparing.prepare("dropped", slow_read))
        await asyncio.to_thread(started.wait, 5)
        preparing.abort("dropped")  # the router gave up while the adapter was read
        release.set()
        assert await dropped is None
        assert not preparing.aborted  # nothing left behind

        preparing.abort("unknown")  # an abort for no request being made is nothing
        assert await preparing.prepare("unknown", lambda: "request") == "request"

    asyncio.run(scenario())


def test_a_refusal_while_making_the_request_reaches_the_caller():
    def refused():
        raise InvalidRequestError("lora_path", "rank 128; max_lora_rank is 64")

    preparing = OffLoopPreparation()
    with pytest.raises(InvalidRequestError, match="max_lora_rank"):
        asyncio.run(preparing.prepare("bad", refused))
    assert not preparing.aborted
