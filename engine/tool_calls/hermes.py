"""The Hermes (Qwen 2.5) tool-call format, the one kvloom renders for templates that take no tools:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`structural_tag` constrains the output with xgrammar's structural tags: `auto` leaves text free until the model
writes `<tool_call>`, then the call must name a tool and its arguments must match that tool's `parameters`;
`required` allows calls only (at least one), `named` exactly one call of that tool. So every call that comes out
parses and validates. `CallStream` splits a streamed output into content and OpenAI's tool-call deltas (name
first, then the arguments in pieces), holding back what might be the start of markup so none leaks into content.
"""

import json
import re
from dataclasses import dataclass

from kvloom.engine.tool_calls.tools import ToolCall, ToolUse

START, END = "<tool_call>", "</tool_call>"
CALL_BEGIN = '<tool_call>\n{"name": "'
ARGUMENTS_BEGIN = '", "arguments": '
CALL_END = "}\n</tool_call>"
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')  # then the arguments
SYSTEM_BLOCK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def structural_tag(use: ToolUse) -> dict:
    """xgrammar's structural tag for the request's tool use (see the module's docstring)."""
    tags = [{"type": "tag", "begin": CALL_BEGIN + tool.function.name + ARGUMENTS_BEGIN,
             "content": {"type": "json_schema", "json_schema": tool.function.parameters,
                         "max_whitespace_cnt": 1}, "end": CALL_END}
            for tool in use.callable]
    if use.mode == "named":
        return {"type": "structural_tag", "format": tags[0]}
    if use.mode == "required":
        return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                                     "at_least_one": True, "stop_after_first": not use.parallel}}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [START], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": not use.parallel}}


def system_block(use: ToolUse) -> str:
    return SYSTEM_BLOCK.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in use.function_dicts()))


def call_text(call: ToolCall) -> str:
    """A past call as the model would have written it."""
    return f'{CALL_BEGIN}{call.function.name}{ARGUMENTS_BEGIN}{call.function.arguments}{CALL_END}'


def result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the JSON text the model wrote


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output's content (None when empty) and calls."""
    stream = CallStream()
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p.content for p in pieces if p.content)
    calls: dict[int, ParsedCall] = {}
    for piece in pieces:
        if piece.call_index is not None and piece.call_index < stream.calls:  # a call cut short is not one
            call = calls.setdefault(piece.call_index, ParsedCall(piece.name or "", ""))
            call.arguments += piece.arguments
    return content.strip() or None, list(calls.values())


@dataclass
class Piece:
    """A part of a streamed output: content text, or (with `call_index`) a call's name or a piece of its arguments."""

    content: str = ""
    call_index: int | None = None
    name: str | None = None  # set in a call's first piece
    arguments: str = ""


@dataclass
class CallStream:
    """A streamed output split into content and calls, as its text arrives."""

    calls: int = 0
    _pending: str = ""
    _in_call: bool = False
    _named: bool = False

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while self._pending:
            if not self._in_call:
                start = self._pending.find(START)
                if start < 0:  # keep what could begin the start tag
                    keep = next((n for n in range(min(len(START) - 1, len(self._pending)), 0, -1)
                                 if START.startswith(self._pending[-n:])), 0)
                    self._emit_content(pieces, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._emit_content(pieces, self._pending[:start])
                self._pending, self._in_call, self._named = self._pending[start + len(START):], True, False
            elif not self._named:
                header = HEADER.match(self._pending)
                if header is None:
                    break  # the name is not all here yet
                pieces.append(Piece(call_index=self.calls, name=json.loads(f'"{header.group(1)}"')))
                self._pending, self._named = self._pending[header.end():], True
            else:
                end = self._pending.find(END)
                if end < 0:  # hold back what could be the call's closing "}" and the end tag
                    safe = len(self._pending) - len(CALL_END)
                    if safe > 0:
                        pieces.append(Piece(call_index=self.calls, arguments=self._pending[:safe]))
                        self._pending = self._pending[safe:]
                    break
                rest = self._pending[:end].rstrip()
                pieces.append(Piece(call_index=self.calls, arguments=rest[:-1].rstrip() if rest.endswith("}") else rest))
                self._pending, self._in_call, self.calls = self._pending[end + len(END):], False, self.calls + 1
        return pieces

    def finish(self) -> list[Piece]:
        """The rest once the output ended: held-back text is content (a call cut short stays unfinished)."""
        pieces: list[Piece] = []
        if not self._in_call:
            self._emit_content(pieces, self._pending)
        self._pending = ""
        return pieces

    def _emit_content(self, pieces: list[Piece], text: str) -> None:
        if text.strip() or (text and not self.calls):  # the separator between calls is not content
            pieces.append(Piece(content=text))
