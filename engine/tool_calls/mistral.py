"""Mistral's tool calls (its v3 tokenizer's), vLLM's `mistral`: one list of JSON calls after `[TOOL_CALLS]`.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1}}]

Mistral's templates check that a call's id is nine letters or digits, so its ids are.
"""

import random
import re
import string

from kvloom.engine.tool_calls.json_calls import CALL, JsonCallStream, JsonCallSyntax
from kvloom.engine.tool_calls.tool_format import ToolFormat, json_schema_content
from kvloom.engine.tool_calls.tools import FunctionDefinition, ToolCall

TRIGGER = "[TOOL_CALLS]"
SYNTAX = JsonCallSyntax(opener=TRIGGER, header=re.compile(r"\s*\[?" + CALL),
                        after=re.compile(r"\s*\}\s*(?:(?P<more>,)|\])"))
ID_CHARACTERS = string.ascii_letters + string.digits
INSTRUCTIONS = """You can call the following functions:

{tools}

To call functions, answer with {trigger} and a JSON list of the calls, each with the function's name and its \
arguments: {trigger}[{{"name": <function-name>, "arguments": <args-json-object>}}]"""


class Mistral(ToolFormat):
    name = "mistral"
    trigger = TRIGGER
    separator = ", "
    block = (TRIGGER + "[", "]")

    def call_tag(self, function: FunctionDefinition) -> dict:
        return {"type": "tag", "begin": f'{{"name": "{function.name}", "arguments": ',
                "content": json_schema_content(function), "end": "}"}

    def stream(self) -> JsonCallStream:
        return JsonCallStream(SYNTAX)

    def instructions(self, tools_json: list[str]) -> str:
        return INSTRUCTIONS.format(tools="\n".join(tools_json), trigger=TRIGGER)

    def calls_text(self, calls: list[ToolCall]) -> str:
        listed = self.separator.join(f'{{"name": "{c.function.name}", "arguments": {c.function.arguments}}}'
                                     for c in calls)
        return f"{self.block[0]}{listed}{self.block[1]}"

    def new_call_id(self) -> str:
        return "".join(random.choices(ID_CHARACTERS, k=9))
