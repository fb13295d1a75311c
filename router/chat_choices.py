"""A chat completion's choices as OpenAI writes them: a whole `message` or streamed `delta`s, with tool calls.

Where the request may call tools, a choice's text goes through the server's tool-call format's parser
(engine/tool_calls/formats.py):
a message gets `tool_calls` (each with an id) and `finish_reason: "tool_calls"`, its content what is left (null
when nothing is); a stream gets OpenAI's deltas, a call's index, id, type and name first, then its `arguments`
in pieces that concatenate to the whole JSON, and no markup in `content`.
"""

from dataclasses import dataclass, field

from kvloom.engine.tool_calls.call_stream import CallStream
from kvloom.engine.tool_calls.tool_format import ToolFormat
from kvloom.replicas.messages import Chunk
from kvloom.router.completion_choices import prompt_logprobs_field
from kvloom.router.protocol import ChatCompletionRequest
from kvloom.router.responses import Choice, LogprobsFormat, joined


@dataclass
class ChatChoices:
    logprobs: LogprobsFormat | None
    tools: ToolFormat | None  # set where the request may call tools: their format
    tokenizer: object = None  # set where the request asks for prompt_logprobs (vLLM's), which the first chunk carries
    _streams: dict[int, CallStream] = field(default_factory=dict)  # a streamed choice's parser
    _ids: dict[tuple[int, int], str] = field(default_factory=dict)  # (choice, call) -> its id

    @staticmethod
    def for_request(body: ChatCompletionRequest, tokenizer) -> "ChatChoices":
        return ChatChoices(LogprobsFormat(tokenizer, body.top_n) if body.top_n is not None else None,
                           tools=body.tool_format if body.tool_use() is not None else None,
                           tokenizer=tokenizer if body.prompt_logprobs is not None else None)

    def message(self, choice: Choice, chunks: list[Chunk]) -> dict:
        token_ids, token_logprobs, reason = joined(chunks)
        content = "".join(c.text for c in chunks)
        message = {"role": "assistant", "content": content}
        if self.tools is not None:
            message["content"], calls = self.tools.parse(content)
            if calls:
                message["tool_calls"] = [{"id": self.tools.new_call_id(), "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        written = {"index": choice.index, "finish_reason": reason, "message": message,
                   "logprobs": self.logprobs.chat(token_ids, token_logprobs) if self.logprobs else None}
        if self.tokenizer is not None:
            written["prompt_logprobs"] = prompt_logprobs_field(chunks[0].prompt_logprobs or [], self.tokenizer)
        return written

    def delta(self, choice: Choice, chunk: Chunk) -> dict:
        reason = chunk.finish_reason
        if self.tools is not None:
            delta = self._tool_delta(choice.index, chunk)
            if reason == "stop" and self._streams[choice.index].calls:
                reason = "tool_calls"
        else:
            delta = {"content": chunk.text} if chunk.text or not reason else {}
        if chunk is choice.first:
            delta["role"] = "assistant"
        return {"index": choice.index, "delta": delta, "finish_reason": reason,
                "logprobs": self.logprobs.chat(chunk.token_ids, chunk.logprobs) if self.logprobs else None}

    def _tool_delta(self, index: int, chunk: Chunk) -> dict:
        stream = self._streams.setdefault(index, self.tools.stream())
        pieces = stream.feed(chunk.text) + (stream.finish() if chunk.finish_reason else [])
        delta: dict = {}
        if content := "".join(p.content for p in pieces):
            delta["content"] = content
        calls = []
        for piece in (p for p in pieces if p.call_index is not None):
            if piece.name is not None:
                self._ids[index, piece.call_index] = self.tools.new_call_id()
                calls.append({"index": piece.call_index, "id": self._ids[index, piece.call_index], "type": "function",
                              "function": {"name": piece.name, "arguments": ""}})
            elif piece.arguments:
                calls.append({"index": piece.call_index, "function": {"arguments": piece.arguments}})
        if calls:
            delta["tool_calls"] = calls
        return delta
