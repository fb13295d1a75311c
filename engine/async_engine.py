"""AsyncLLMEngine: a background step loop with one async stream per request.

The engine runs in its own thread so a forward pass never blocks the caller's event loop.
Callers talk to it through a command queue drained at the top of every step (the engine's
state is only ever touched by its thread); outputs travel back with `call_soon_threadsafe`.
Cancelling a `generate()` iterator aborts the request and frees its blocks.
"""

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvloom.engine.config import EngineConfig
from kvloom.engine.llm_engine import EngineStats, LLMEngine
from kvloom.engine.outputs import RequestOutput
from kvloom.engine.request import Request
from kvloom.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop crashed; the engine serves nothing more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.queue.put_nowait(output)


def _coalesce(output: RequestOutput, pending: asyncio.Queue) -> tuple[RequestOutput, BaseException | None]:
    """`output` joined with the outputs already queued behind it: one item carrying all their new tokens.

    A consumer that keeps up gets every step's output on its own; one that falls behind (a replica's
    stream through Ray to the router and the HTTP proxy, all sharing a few cores with the engine) gets
    one item per pull instead of a backlog of one-token items, each costing a Ray message and an SSE
    event. Outputs are cumulative, so the last one stands for all; only the deltas are joined. An error
    found behind them is returned, for the caller to raise after yielding what came before it.
    """
    while not output.finished and not pending.empty():
        later = pending.get_nowait()
        if isinstance(later, BaseException):
            return output, later
        for before, after in zip(output.outputs, later.outputs):
            after.delta_text = before.delta_text + after.delta_text
            after.delta_token_ids = before.delta_token_ids + after.delta_token_ids
        output = later
    return output, None


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, num_threads: int | None = None) -> None:
        """Loads the model on the engine's own thread, the one that will run every step, and returns once
        it is loaded (or raises what loading raised). `num_threads`: torch intra-op threads for it.

        One thread for both, because each thread that runs torch ops owns an OpenMP team: a team left by
        loading elsewhere puts libgomp's threads over the CPU count, where libgomp waits with its short
        throttled spin instead of GOMP_SPINCOUNT's (as its environment handling reads), so ops pay the
        kernel's wake-up again. Loaded on another thread, W1 ran at 391 out tok/s; on the stepping
        thread, 565 (in-process, measured).
        """
        self.num_threads = num_threads
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config or EngineConfig(),), name="kvloom-engine",
                                        daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self.dead_error is not None:
            raise self.dead_error

    # ---- caller side ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream incremental outputs; raises InvalidRequestError before anything is queued."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        request = self.engine.make_request(request_id, prompt, params, priority)
        async for output in self.generate_request(request):
            yield output

    async def generate_request(
        self, request: Request, start: Callable[[LLMEngine], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a prepared request; `start` (default: queue it) runs on the engine thread."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        self._send(start or (lambda engine: engine.add_prepared(request)), stream)
        finished = False
        error: BaseException | None = None  # met while coalescing: raised after what came before it
        try:
            while not finished:
                if error is not None:
                    raise error
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                item, error = _coalesce(item, stream.queue)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._send(lambda engine: engine.abort(request_id))

    async def run_on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread (the only one that may touch engine state)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def call(engine: LLMEngine) -> None:
            try:
                result = fn(engine)
            except Exception as exc:
                loop.call_soon_threadsafe(future.set_exception, exc)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._send(call)
        return await future

    def set_num_threads(self, num_threads: int) -> None:
        """Change the step loop's thread count. OpenMP's count is per calling thread, so it is set on the
        engine's own thread (setting it anywhere else would not reach the step loop)."""
        self.num_threads = num_threads
        self._send(lambda engine: torch.set_num_threads(num_threads))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine loop died: {self.dead_error!r}")
        if not self._thread.is_alive() and not self._stopped:
            raise EngineDeadError("engine loop is not running")

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, fn: Callable[[LLMEngine], object], errors_to: _Stream | None = None) -> None:
        self._commands.put((fn, errors_to))
        self._wake.set()

    # ---- engine thread ----------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                fn, errors_to = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fn(self.engine)
            except Exception as exc:  # e.g. a duplicate id: fail that stream only
                if errors_to is None:
                    raise
                errors_to.put(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per request.

        Each call_soon_threadsafe wakes the consumer's loop, whose thread then takes a core from the
        step running beside it (on a 2-core host its OpenMP team waits at every barrier for that core);
        W1 in-process went 376 -> 386 out tok/s with one wake-up a step instead of one an output.
        """
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _run(self, config: EngineConfig) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            self.engine = LLMEngine(config)
        except BaseException as exc:  # raised to the constructor's caller
            self.dead_error = exc
            return
        finally:
            self._loaded.set()
        try:
            while not self._stopped:
                self._wake.clear()
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=1.0)
                    continue
                self._deliver(self.engine.step())
        except BaseException as exc:
            logger.exception("kvloom engine loop died")
            self.dead_error = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"engine loop died: {exc!r}"))
