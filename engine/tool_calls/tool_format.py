"""What a tool-call format is to kvloom: the grammar its calls are constrained to, how a template that takes no
tools is told about them (the fallback), how past calls and results are written back, and its output parser.

The grammar is xgrammar's structural tag, built the same way for every format from one call's tag: `named` is
that tool's tag; `required` one or more tags (one where parallel calls are off) joined by the format's separator,
inside its block where it has one (Mistral's `[TOOL_CALLS][...]`); `auto` leaves text free until the format's
trigger, then the call (or block) must be complete and valid.
"""

import json
import uuid
from abc import ABC, abstractmethod
from typing import ClassVar

from kvloom.engine.tool_calls.call_stream import CallStream, ParsedCall, parse
from kvloom.engine.tool_calls.tools import FunctionDefinition, Tool, ToolCall, ToolChoice, ToolUse, tool_use


class ToolFormat(ABC):
    name: ClassVar[str]  # vLLM's `tool_call_parser` name
    trigger: ClassVar[str]  # what the model writes to begin calling (auto mode)
    separator: ClassVar[str]  # between two calls
    block: ClassVar[tuple[str, str] | None] = None  # what encloses a group of calls, if anything

    @abstractmethod
    def call_tag(self, function: FunctionDefinition) -> dict:
        """xgrammar's tag for one call of `function`, its arguments valid against its parameters."""

    @abstractmethod
    def stream(self) -> CallStream:
        """A parser for one output."""

    @abstractmethod
    def instructions(self, tools_json: list[str]) -> str:
        """The fallback: the system turn's text that describes the tools (each a JSON line) and the format."""

    @abstractmethod
    def calls_text(self, calls: list[ToolCall]) -> str:
        """Past calls as the model would have written them (the fallback's history)."""

    def result_text(self, content: str) -> str:
        """A tool's result as the fallback writes it into a user turn."""
        return content

    def tool_use(self, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolUse | None:
        """What a request asks of its tools (tools.py's `tool_use`), refused where this format cannot call them."""
        use = tool_use(tools, choice, parallel)
        if use is not None:
            self.check(use)
        return use

    def check(self, use: ToolUse) -> None:
        """Refuse (InvalidRequestError naming the field) tools this format cannot call."""

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def structural_tag(self, use: ToolUse) -> dict:
        tags = [self.call_tag(tool.function) for tool in use.callable]
        calls = tags[0] if use.mode == "named" else {
            "type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
            "stop_after_first": not use.parallel}
        if self.block is not None:
            calls = {"type": "tag", "begin": self.block[0], "content": calls, "end": self.block[1]}
        if use.mode != "auto":
            return {"type": "structural_tag", "format": calls}
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [self.trigger], "tags": [calls] if self.block else tags,
            "at_least_one": False, "stop_after_first": not use.parallel}}

    def system_block(self, use: ToolUse) -> str:
        return self.instructions([json.dumps(tool, ensure_ascii=False) for tool in use.function_dicts()])

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole output's content (None when empty) and calls."""
        return parse(self.stream(), text)


def json_schema_content(function: FunctionDefinition) -> dict:
    return {"type": "json_schema", "json_schema": function.parameters, "max_whitespace_cnt": 1}
