"""OpenAI response bodies from the replicas' chunks: whole, or as server-sent events, for one choice or
several (one per prompt of a /v1/completions request), with logprobs, and usage at the end or, with
vLLM's `continuous_usage_stats`, in every chunk.

A chunk (replicas/messages.py) is what a replica sends per step for one request: `text` and `token_ids` new since the last,
their `logprobs` (per token a {token id: logprob} map, the chosen token first, then the top
alternatives), `finish_reason`, and the usage counts so far.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.replicas.messages import Chunk
from kvloom.router.dispatcher import Job
from kvloom.router.errors import APIError


@dataclass
class Choice:
    """One generation on its way: its first chunk (already received) and the rest of its stream."""
    index: int
    first: Chunk
    stream: AsyncIterator[Chunk]
    prefix: str = ""  # `echo`: the prompt's text, sent before the generated text
    sent_chars: int = 0  # text already sent (completions' logprobs count text offsets from it)
    chunks: list[Chunk] = field(default_factory=list)
    shares_prompt: bool = False  # a prompt's later choice: its prompt is counted with the first one's


class ReadAhead:
    """A started choice's stream, read into a queue while the request's other choices start. Until the last
    choice has started nothing else reads the earlier ones, and a stream that is not read never reaches its
    end, where the dispatcher gives its replica slot back: a request with more choices than free slots
    would wait forever for a slot that its own finished choices hold. An error mid-stream reaches the
    reader in turn; `aclose` stops the stream wherever it is."""

    _END = object()

    def __init__(self, stream: AsyncIterator[Chunk]) -> None:
        self._stream = stream
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            async for chunk in self._stream:
                self._queue.put_nowait(chunk)
        except Exception as exc:
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(self._END)

    def __aiter__(self) -> "ReadAhead":
        return self

    async def __anext__(self) -> Chunk:
        item = await self._queue.get()
        if isinstance(item, Chunk):
            return item
        self._queue.put_nowait(item)  # the stream stays ended
        if isinstance(item, Exception):
            raise item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._stream.aclose()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _usage(prompt: int, cached: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chunk_usage(chunk: Chunk) -> dict:
    """One choice's counts so far (vLLM's `continuous_usage_stats`): a forked choice shows its prompt as cached."""
    return _usage(chunk.prompt_tokens, chunk.cached_tokens, chunk.completion_tokens)


def usage(latest: list[tuple[Choice, Chunk]]) -> dict:
    """A request's usage from each choice's latest chunk (its counts so far). Each prompt counts once
    however many choices it has, as OpenAI and vLLM count it; every generated token counts."""
    own = [chunk for choice, chunk in latest if not choice.shares_prompt]
    return _usage(sum(c.prompt_tokens for c in own), sum(c.cached_tokens for c in own),
                  sum(chunk.completion_tokens for _, chunk in latest))


def joined(chunks: list[Chunk]) -> tuple[list[int], list[dict], str | None]:
    """A whole choice from its chunks: token ids, logprobs (empty unless asked) and finish reason."""
    token_ids = [t for c in chunks for t in c.token_ids]
    token_logprobs = [lp for c in chunks for lp in c.logprobs or ()]
    return token_ids, token_logprobs, chunks[-1].finish_reason


class LogprobsFormat:
    """Per-token logprobs in the two shapes OpenAI uses: chat's `content` list and completions' columns."""

    def __init__(self, tokenizer, top_n: int) -> None:
        self.tokenizer = tokenizer
        self.top_n = top_n

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top(self, alternatives: dict) -> list[tuple[int, float]]:
        # the chosen token leads the map; if it is not among the top n, it is the smallest entry
        return sorted(((int(t), v) for t, v in alternatives.items()), key=lambda tv: -tv[1])[: self.top_n]

    def chat(self, token_ids: list[int], logprobs: list[dict]) -> dict:
        def entry(token_id: int, value: float) -> dict:
            text = self._text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {"content": [
            {**entry(t, float(next(iter(alternatives.values())))),
             "top_logprobs": [entry(a, v) for a, v in self._top(alternatives)]}
            for t, alternatives in zip(token_ids, logprobs)]}

    def completion(self, token_ids: list[int], logprobs: list[dict | None], offset: int) -> dict:
        """None for a token with no logprob (an echoed prompt's first)."""
        tokens = [self._text(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [None if a is None else float(next(iter(a.values()))) for a in logprobs],
                "top_logprobs": [None if a is None else {self._text(t): v for t, v in self._top(a)} for a in logprobs],
                "text_offset": offsets}


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Chunk]]:
    """Every choice's chunks as they come (the first ones first); one choice is read directly."""
    for choice in choices:
        yield choice, choice.first
    if len(choices) == 1:
        async for chunk in choices[0].stream:
            yield choices[0], chunk
        return
    pending = {asyncio.ensure_future(anext(c.stream)): c for c in choices if c.first.finish_reason is None}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                choice = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    continue
                yield choice, chunk
                pending[asyncio.ensure_future(anext(choice.stream))] = choice
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # settled, so the streams can be closed


StartChoice = Callable[[Job], Awaitable[tuple[Chunk, AsyncIterator[Chunk]]]]


async def start_choices(jobs: list[Job], per_prompt: int, start: StartChoice) -> list[Choice]:
    """Start one HTTP request's jobs (its prompts times `per_prompt`), each up to its first chunk (`start`), so
    a bad job is a 400 before any byte is sent. Prompts start at once, so the engine batches their prefills
    in one step; a prompt's choices start in turn, each once the one before has its first token, so they
    fork its prompt KV (see `fork_siblings`). Every started choice is read ahead while the others start.
    If any fails, every started one is closed and the first failure (in job order) is raised."""
    if len(jobs) == 1:
        return [Choice(0, *await start(jobs[0]))]
    started: list[Choice] = []

    async def start_prompt(first: int) -> None:
        for index in range(first, first + per_prompt):
            head, stream = await start(jobs[index])
            started.append(Choice(index, head, ReadAhead(stream), shares_prompt=jobs[index].shares_prompt))

    try:
        outcomes = await asyncio.gather(*(start_prompt(i) for i in range(0, len(jobs), per_prompt)),
                                        return_exceptions=True)
        if failed := [o for o in outcomes if isinstance(o, BaseException)]:
            raise failed[0]
    except BaseException:
        await close(started)
        raise
    return sorted(started, key=lambda choice: choice.index)


async def close(choices: list[Choice]) -> None:
    """Stop every choice's stream, aborting what still runs. Shielded: when the client goes away the caller
    is cancelled, and Starlette cancels again at each await, so an unshielded loop would stop after the
    first choice that awaits and leave the later ones generating."""
    async def close_all() -> None:
        for choice in choices:
            await choice.stream.aclose()

    await asyncio.shield(close_all())


def stream_response(head: dict, choices: list[Choice], make_choice: Callable[[Choice, Chunk], dict],
                    include_usage: bool, continuous_usage: bool) -> StreamingResponse:
    """Server-sent events: one event per chunk of any choice, an error event if a stream fails midway."""
    async def events() -> AsyncIterator[str]:
        latest = {c.index: (c, c.first) for c in choices}
        try:
            async for choice, chunk in merged(choices):
                latest[choice.index] = choice, chunk
                event = {**head, "choices": [make_choice(choice, chunk)]}
                if continuous_usage:
                    event["usage"] = chunk_usage(chunk)
                yield _sse(event)
        except APIError as exc:
            yield _sse(exc.body())
        else:
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage(list(latest.values()))})
        finally:
            await close(choices)
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def most_likely(choices: list[Choice], candidates: int, n: int) -> list[Choice]:
    """`best_of`: of each prompt's `candidates` finished generations (consecutive), the `n` whose tokens have
    the highest summed logprob, most likely first, renumbered i*n+j as OpenAI numbers choices."""
    def cumulative_logprob(choice: Choice) -> float:
        return sum(float(next(iter(alternatives.values()))) for alternatives in joined(choice.chunks)[1])

    kept = []
    for prompt, start in enumerate(range(0, len(choices), candidates)):
        ranked = sorted(choices[start : start + candidates], key=cumulative_logprob, reverse=True)
        for j, choice in enumerate(ranked[:n]):
            choice.index = prompt * n + j
            kept.append(choice)
    return kept


async def collect_response(head: dict, choices: list[Choice], make_choice: Callable[[Choice, list[Chunk]], dict],
                           keep: Callable[[list[Choice]], list[Choice]] | None = None) -> JSONResponse:
    """One body once every choice has finished; `make_choice` gets a choice's chunks in order. `keep` picks
    the choices returned (best_of); usage counts every one generated."""
    try:
        async for choice, chunk in merged(choices):
            choice.chunks.append(chunk)
    except APIError as exc:
        return exc.response()
    finally:
        await close(choices)
    returned = keep(choices) if keep else choices
    return JSONResponse({**head, "choices": [make_choice(c, c.chunks) for c in returned],
                         "usage": usage([(c, c.chunks[-1]) for c in choices])})
