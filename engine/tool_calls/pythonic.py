"""Pythonic tool calls (Llama 3.2's and Llama 4's), vLLM's `pythonic`: a Python list of calls with keyword arguments.

    [get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]

The arguments are constrained by a grammar made from each tool's schema (pythonic_grammar.py). A call's arguments
come out as JSON, whole, once the list is complete (a Python literal is not JSON until it is parsed).
"""

import ast
import json
import re

from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.tool_calls.call_stream import CallStream, Piece
from kvloom.engine.tool_calls.pythonic_grammar import arguments_grammar, python_literal
from kvloom.engine.tool_calls.tool_format import ToolFormat
from kvloom.engine.tool_calls.tools import FunctionDefinition, ToolCall, ToolUse

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
INSTRUCTIONS = """You are an expert in composing functions. You are given a question and a set of possible functions. \
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.

If you decide to invoke any of the function(s), you MUST put it in the format of \
[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]
You SHOULD NOT include any other text in the response if you call a function.

Here is a list of functions in JSON format that you can invoke.
[{tools}]"""


class Pythonic(ToolFormat):
    name = "pythonic"
    trigger = "["
    separator = ", "
    block = ("[", "]")

    def call_tag(self, function: FunctionDefinition) -> dict:
        return {"type": "tag", "begin": f"{function.name}(", "end": ")",
                "content": {"type": "grammar", "grammar": arguments_grammar(function.parameters)}}

    def structural_tag(self, use: ToolUse) -> dict:
        """`auto` is triggered by `[` and a tool's name, not by every `[` in prose; the rest as every format."""
        if use.mode != "auto":
            return super().structural_tag(use)
        tags = [self.call_tag(tool.function) for tool in use.callable]
        more = [] if not use.parallel else [{"type": "star", "content": {"type": "sequence", "elements": [
            {"type": "const_string", "value": self.separator}, {"type": "or", "elements": tags}]}}]
        blocks = [{"type": "tag", "begin": f"[{tag['begin']}", "end": "]", "content": {
            "type": "sequence", "elements": [tag["content"], {"type": "const_string", "value": ")"}, *more]}}
            for tag in tags]
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [b["begin"] for b in blocks], "tags": blocks, "at_least_one": False,
            "stop_after_first": not use.parallel}}

    def stream(self) -> "PythonicCallStream":
        return PythonicCallStream()

    def instructions(self, tools_json: list[str]) -> str:
        return INSTRUCTIONS.format(tools=", ".join(tools_json))

    def calls_text(self, calls: list[ToolCall]) -> str:
        written = ", ".join(f"{c.function.name}(" + ", ".join(
            f"{k}={python_literal(v)}" for k, v in json.loads(c.function.arguments or "{}").items()) + ")"
            for c in calls)
        return f"[{written}]"

    def check(self, use: ToolUse) -> None:
        for i, tool in enumerate(use.tools):
            names = [tool.function.name, *tool.function.parameters.get("properties", {})]
            if not all(IDENTIFIER.fullmatch(name) for name in names):
                raise InvalidRequestError(f"tools.{i}.function", "pythonic tool calls need a name and parameter "
                                                                 "names that are Python identifiers")


class PythonicCallStream(CallStream):
    opener = re.compile(r"\[(?=[A-Za-z_][A-Za-z0-9_]*\()")
    partial_opener = re.compile(r"\[[A-Za-z0-9_]*$")

    def __init__(self) -> None:
        super().__init__()
        self._open()

    def _open(self) -> None:
        self._block, self._depth, self._quote, self._escaped = "[", 1, None, False  # within the list, outside strings

    def _advance(self, pieces: list[Piece]) -> bool:
        for i, char in enumerate(self._pending):
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = None
            elif char in "\"'":
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._block += self._pending[: i + 1]
                    self._pending, self._inside = self._pending[i + 1:], False
                    self._emit_calls(pieces)
                    return True
        self._block += self._pending
        self._pending = ""
        return False

    def _emit_calls(self, pieces: list[Piece]) -> None:
        calls = _calls(self._block)
        if calls is None:  # not a list of calls after all
            self._emit_content(pieces, self._block)
            return
        for name, arguments in calls:
            pieces.append(Piece(call_index=self.calls, name=name))
            pieces.append(Piece(call_index=self.calls, arguments=arguments))
            self.calls += 1


def _calls(text: str) -> list[tuple[str, str]] | None:
    """A Python list of calls with literal keyword arguments as (name, arguments JSON), or None if it is not one."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not all(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args
                and all(k.arg for k in c.keywords) for c in tree.elts):
            return None
        return [(c.func.id, json.dumps({k.arg: ast.literal_eval(k.value) for k in c.keywords}, ensure_ascii=False))
                for c in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None
