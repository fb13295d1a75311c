"""AsyncLLMEngine: a background step loop with async streams of its outputs.

The engine runs in its own thread so a forward pass never blocks the caller's event loop.
Callers talk to it through a command queue drained at the top of every step (the engine's
state is only ever touched by its thread); outputs travel back with `call_soon_threadsafe`,
to one async stream per request (`generate`) or to an `OutputBatches` that carries many
requests' outputs a step at a time. Cancelling a stream aborts what it carried and frees its blocks.
"""

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

from kvloom.engine.config import EngineConfig
from kvloom.engine.cpu_threads import ENGINE_THREAD_NAME, name_os_thread, schedule_normally
from kvloom.engine.errors import EngineDeadError, InvalidRequestError
from kvloom.engine.engine_stats import EngineReport, EngineStats
from kvloom.engine.kv_handoff import KVHeader
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.lora.identity import LoRARequest
from kvloom.engine.outputs import RequestOutput
from kvloom.engine.request import Request
from kvloom.engine.sampling import SamplingParams
from kvloom.kernels.item_pool import set_intra_op_threads

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class FailedRequest:
    """A request the engine refused after it was queued (e.g. a continuation it cannot resume): it ends here."""

    request_id: str
    error: Exception


@dataclass
class _Stream:
    """One request's outputs, in order."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def accept(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.queue.put_nowait(output)

    def fail(self, error: BaseException, request_id: str | None = None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, error)


def _accept_all(items: list[tuple["_Stream | OutputBatches", list[RequestOutput]]]) -> None:
    for sink, outputs in items:
        sink.accept(outputs)


def _join(before: RequestOutput, after: RequestOutput) -> RequestOutput:
    """`after` carrying `before`'s new tokens too: outputs are cumulative (logprobs too), so only the deltas
    are joined."""
    for earlier, later in zip(before.outputs, after.outputs):
        later.delta_text = earlier.delta_text + later.delta_text
        later.delta_token_ids = earlier.delta_token_ids + later.delta_token_ids
    return after


def _coalesce(output: RequestOutput, pending: asyncio.Queue) -> tuple[RequestOutput, BaseException | None]:
    """`output` joined with the outputs already queued behind it: one item carrying all their new tokens.

    A consumer that keeps up gets every step's output on its own; one that falls behind (a replica's
    stream through Ray to the router and the HTTP proxy, all sharing a few cores with the engine) gets
    one item per pull instead of a backlog of one-token items, each costing a Ray message and an SSE
    event. An error found behind them is returned, for the caller to raise after yielding what came
    before it.
    """
    while not output.finished and not pending.empty():
        later = pending.get_nowait()
        if isinstance(later, BaseException):
            return output, later
        output = _join(output, later)
    return output, None


class OutputBatches:
    """Many requests' outputs through one queue, a step's worth at a time.

    For a consumer that forwards outputs in bulk: a replica's channel to the router sends one Ray
    message per engine step instead of one per running request, which was most of what serving cost
    beyond the forward pass. `next_batch` joins whatever queued since the last call, one output per
    request. `close` aborts the requests it still carries (their consumer is gone).
    """

    def __init__(self, engine: "AsyncLLMEngine") -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.live: set[str] = set()
        self._error: BaseException | None = None

    def add(self, request: Request, start: Callable[[LLMEngine], None] | None = None) -> None:
        """Queue `request` on the engine (by `start`, if given); its outputs come out of `next_batch`.
        Raises InvalidRequestError, queuing nothing, for an id that is still streaming."""
        self.engine.open_stream(request, self, start)
        self.live.add(request.request_id)

    def forget(self, request_id: str) -> None:
        """Abort a request (if it still runs) and drop its outputs from now on."""
        if request_id in self.live:
            self.live.discard(request_id)
            self.engine.close_stream(request_id)

    def accept(self, outputs: list[RequestOutput]) -> None:
        self.queue.put_nowait(outputs)

    def fail(self, error: BaseException, request_id: str | None = None) -> None:
        item = error if request_id is None else [FailedRequest(request_id, error)]
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def next_batch(self) -> list[RequestOutput | FailedRequest]:
        """Wait for outputs; raises once the engine died (after handing over what came before)."""
        if self._error is not None:
            raise self._error
        joined: dict[str, RequestOutput | FailedRequest] = {}
        item = await self.queue.get()
        while True:
            if isinstance(item, BaseException):
                self._error = item
                break
            for output in item:
                if output.request_id not in self.live:  # forgotten while its last outputs were on the way
                    continue
                before = joined.get(output.request_id)
                joined[output.request_id] = (_join(before, output) if isinstance(before, RequestOutput)
                                             and isinstance(output, RequestOutput) else output)
            if self.queue.empty():
                break
            item = self.queue.get_nowait()
        if not joined and self._error is not None:
            raise self._error
        for request_id, output in joined.items():
            if isinstance(output, FailedRequest) or output.finished:
                self.live.discard(request_id)
                self.engine.stream_ended(request_id)
        return list(joined.values())

    def close(self) -> None:
        for request_id in list(self.live):
            self.forget(request_id)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, num_threads: int | None = None,
                 tensor_parallel_launch: dict | None = None) -> None:
        """Loads the model on the engine's own thread, the one that will run every step, and returns once
        it is loaded (or raises what loading raised). `num_threads`: torch intra-op threads for it.

        One thread for both, because each thread that runs torch ops owns an OpenMP team: a team left by
        loading elsewhere puts libgomp's threads over the CPU count, where libgomp waits with its short
        throttled spin instead of GOMP_SPINCOUNT's, so ops pay the kernel's wake-up again (W1 ~30% slower,
        docs/performance.md). `tensor_parallel_launch`: see LLMEngine.
        """
        self._tensor_parallel_launch = tensor_parallel_launch
        self.num_threads = num_threads
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream | OutputBatches] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config or EngineConfig(),), name=ENGINE_THREAD_NAME,
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
        request = self.make_request(request_id or uuid.uuid4().hex, prompt, params, priority)
        async for output in self.generate_request(request):
            yield output

    async def generate_request(
        self, request: Request, start: Callable[[LLMEngine], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a prepared request; `start` (default: queue it) runs on the engine thread."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self.open_stream(request, stream, start)
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
            if finished:
                self.stream_ended(request.request_id)
            else:
                self.close_stream(request.request_id)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, lora: LoRARequest | None = None, cache_namespace: int | None = None) -> Request:
        """Validate and tokenize; any thread may call it (see LLMEngine.make_request)."""
        return self.engine.make_request(request_id, prompt, params, priority, lora=lora,
                                        cache_namespace=cache_namespace)

    def load_adapter(self, lora: LoRARequest) -> None:
        """Read and check a LoRA adapter now (thread-safe, as make_request); raises InvalidRequestError."""
        self.engine.load_adapter(lora)

    def abort(self, request_id: str) -> None:
        self._send(lambda engine: engine.abort(request_id))

    def open_stream(self, request: Request, sink: "_Stream | OutputBatches",
                    start: Callable[[LLMEngine], None] | None = None) -> None:
        """Queue `request` (by `start` on the engine thread, if given), its outputs going to `sink`. Refused
        here, not on the engine thread, while the id still streams: its twin would take over the stream, and
        failing or closing the twin would then abort the original."""
        if request.request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self._streams[request.request_id] = sink
        self._send(start or (lambda engine: engine.add_prepared(request)), sink, request.request_id)

    def close_stream(self, request_id: str) -> None:
        """The stream's consumer is gone: abort the request (if it still runs)."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def stream_ended(self, request_id: str) -> None:
        """The request finished (or failed) and its consumer has its last output: the id may be used again."""
        self._streams.pop(request_id, None)

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
        self._send(lambda engine: set_intra_op_threads(num_threads))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def device(self):
        return self.engine.device

    def is_parked(self, request_id: str) -> bool:
        """Whether a finished prefill's KV waits for its hand-off (read as it stands: the engine parks a request
        before its last output is delivered)."""
        return self.engine.handoffs.parked(request_id) is not None

    def kv_header(self, num_tokens: int) -> KVHeader:
        """What this engine's KV for `num_tokens` tokens looks like (its facts never change after loading)."""
        return KVHeader.for_engine(self.engine, num_tokens)

    @property
    def step_threads(self) -> int | None:
        """Torch threads a step runs on: each rank's under tensor parallelism, else what was asked."""
        return getattr(self.engine.runner, "num_threads", self.num_threads)

    def report(self, recent_prefix_hashes: int, recent_tier_hashes: int) -> EngineReport:
        """Counters and facts for the router; the counters are read without stopping the step (a snapshot
        that may be a step old). `recent_prefix_hashes`: how many of the latest cached blocks' hashes;
        `recent_tier_hashes`: how many of the blocks the KV tiers hold (engine/kv_tiers/recent_hashes.py)."""
        engine = self.engine
        tiers = engine.kv.tiers
        spec = engine.spec_decode_stats
        return EngineReport(
            stats=engine.stats(), device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
            block_size=engine.block_size, max_model_len=engine.max_model_len,
            spec_decode=asdict(spec) if spec else None,
            recent_prefix_hashes=engine.kv.pool.recent_hashes(recent_prefix_hashes),
            recent_tier_hashes=tiers.recent_hashes(recent_tier_hashes) if tiers is not None else [],
            ranks=list(getattr(engine.runner, "reports", [])), startup=dict(engine.startup.seconds),
            lora_adapters=engine.adapters.loaded() if engine.adapters is not None else [])

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine loop died: {self.dead_error!r}")
        if not self._thread.is_alive() and not self._stopped:
            raise EngineDeadError("engine loop is not running")
        self.engine.runner.check_health()  # a tensor-parallel worker that died: at once, not at the next step

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, fn: Callable[[LLMEngine], object], errors_to: "_Stream | OutputBatches | None" = None,
              request_id: str | None = None) -> None:
        self._commands.put((fn, errors_to, request_id))
        self._wake.set()

    # ---- engine thread ----------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                fn, errors_to, request_id = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fn(self.engine)
            except Exception as exc:  # a request the engine refuses: fail that request only
                if errors_to is None:
                    raise
                errors_to.fail(exc, request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per request.

        Each call_soon_threadsafe wakes the consumer's loop, whose thread then takes a core from the step
        running beside it.
        """
        by_sink: dict[int, tuple[_Stream | OutputBatches, list[RequestOutput]]] = {}
        for output in outputs:
            sink = self._streams.get(output.request_id)
            if sink is not None:
                by_sink.setdefault(id(sink), (sink, []))[1].append(output)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, batch in by_sink.values():
            by_loop.setdefault(sink.loop, []).append((sink, batch))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_accept_all, items)

    def _run(self, config: EngineConfig) -> None:
        name_os_thread(self._thread.name)
        schedule_normally()
        if self.num_threads:
            set_intra_op_threads(self.num_threads)
        try:
            self.engine = LLMEngine(config, self._tensor_parallel_launch)
            self.engine.warm_up()
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
            for sink in {id(sink): sink for sink in list(self._streams.values())}.values():
                sink.fail(EngineDeadError(f"engine loop died: {exc!r}"))
        finally:
            self.engine.shutdown()
