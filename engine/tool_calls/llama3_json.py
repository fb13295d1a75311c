"""Llama 3.1/3.2's JSON tool calls, vLLM's `llama3_json`: a call is one JSON object, several are joined by "; ".

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

import re

from kvloom.engine.tool_calls.json_calls import NAME, JsonCallStream, JsonCallSyntax
from kvloom.engine.tool_calls.tool_format import ToolFormat, json_schema_content
from kvloom.engine.tool_calls.tools import FunctionDefinition, ToolCall

TRIGGER = '{"name": "'
SYNTAX = JsonCallSyntax(opener=TRIGGER, header=re.compile(NAME), after=re.compile(r"\s*\}"),
                        separators=";")
INSTRUCTIONS = """Given the following functions, please respond with a JSON for a function call with its proper arguments \
that best answers the given prompt.

Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. Do not use \
variables.

{tools}"""


class Llama3Json(ToolFormat):
    name = "llama3_json"
    trigger = TRIGGER
    separator = "; "

    def call_tag(self, function: FunctionDefinition) -> dict:
        return {"type": "tag", "begin": f'{TRIGGER}{function.name}", "parameters": ',
                "content": json_schema_content(function), "end": "}"}

    def stream(self) -> JsonCallStream:
        return JsonCallStream(SYNTAX)

    def instructions(self, tools_json: list[str]) -> str:
        return INSTRUCTIONS.format(tools="\n\n".join(tools_json))

    def calls_text(self, calls: list[ToolCall]) -> str:
        return self.separator.join(f'{TRIGGER}{c.function.name}", "parameters": {c.function.arguments}}}'
                                   for c in calls)
