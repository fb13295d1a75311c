"""A response object, and the stream of events that builds it, from a chat choice's message or deltas
(router/chat_choices.py): text becomes a `message` item of `output_text`, each tool call a `function_call` item.
Streamed: `response.created`, `response.in_progress`, then per item `response.output_item.added`, its deltas
(`response.output_text.delta`, `response.function_call_arguments.delta`) and `...done` events, and
`response.completed` carrying the whole response; each event numbered by `sequence_number`."""

import time
import uuid
from dataclasses import dataclass, field

from kvloom.router.openai_responses.request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, body: ResponsesRequest, created: float, status: str, output: list[dict],
                    usage: dict | None) -> dict:
    return {
        "id": response_id, "object": "response", "created_at": int(created), "status": status, "model": body.model,
        "output": output, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
        else body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text and body.text.format else {"format": {"type": "text"}},
        "usage": usage, "store": body.store, "user": body.user, "background": body.background,
    }


def response_usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(message: dict) -> list[dict]:
    """A chat choice's message as output items."""
    items = [message_item(new_id("msg"), message["content"])] if message.get("content") else []
    items += [call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"])
              for call in message.get("tool_calls") or ()]
    return items


def as_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a later response's history holds."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


@dataclass
class EventStream:
    """The events of one streamed response, from its chat choice's deltas."""

    response_id: str
    body: ResponsesRequest
    created: float = field(default_factory=time.time)
    output: list[dict] = field(default_factory=list)  # items so far, in output order
    _sequence: int = 0
    _text_item: int | None = None  # output index of the open message item
    _calls: dict[int, int] = field(default_factory=dict)  # tool call index -> output index

    def event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def start(self) -> list[dict]:
        snapshot = response_object(self.response_id, self.body, self.created, "in_progress", [], None)
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def delta(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("content"):
            if self._text_item is None:
                events += self._close_calls()
                self._text_item = len(self.output)
                self.output.append(message_item(new_id("msg"), "", status="in_progress"))
                item = self.output[-1]
                events += [self.event("response.output_item.added", output_index=self._text_item, item=dict(item)),
                           self.event("response.content_part.added", item_id=item["id"],
                                      output_index=self._text_item, content_index=0, part=text_part(""))]
                item["text"] = ""
            item = self.output[self._text_item]
            item["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._text_item,
                                     content_index=0, delta=delta["content"], logprobs=[]))
        for piece in delta.get("tool_calls") or ():
            if piece.get("id"):
                events += self._close_text()
                self._calls[piece["index"]] = len(self.output)
                self.output.append(call_item(new_id("fc"), piece["id"], piece["function"]["name"], "", "in_progress"))
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=dict(self.output[-1])))
            elif piece["function"].get("arguments"):
                index = self._calls[piece["index"]]
                self.output[index]["arguments"] += piece["function"]["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                                         output_index=index, delta=piece["function"]["arguments"]))
        return events

    def finish(self, usage: dict | None) -> tuple[list[dict], dict]:
        """The closing events and the finished response."""
        events = self._close_text() + self._close_calls()
        response = response_object(self.response_id, self.body, self.created, "completed", self.output, usage)
        return events + [self.event("response.completed", response=response)], response

    def _close_text(self) -> list[dict]:
        if self._text_item is None:
            return []
        index, self._text_item = self._text_item, None
        item = self.output[index]
        text = item.pop("text")
        self.output[index] = done = message_item(item["id"], text)
        return [self.event("response.output_text.done", item_id=done["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=done["id"], output_index=index, content_index=0,
                           part=text_part(text)),
                self.event("response.output_item.done", output_index=index, item=done)]

    def _close_calls(self) -> list[dict]:
        events = []
        for index in self._calls.values():
            item = self.output[index]
            if item["status"] == "completed":
                continue
            item["status"] = "completed"
            events += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=dict(item))]
        return events
