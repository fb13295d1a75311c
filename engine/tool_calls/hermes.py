"""The Hermes (Qwen 2.5) tool-call format, vLLM's `hermes`, and kvloom's fallback for templates that take no tools:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

import re

from kvloom.engine.tool_calls.json_calls import CALL, JsonCallStream, JsonCallSyntax
from kvloom.engine.tool_calls.tool_format import ToolFormat, json_schema_content
from kvloom.engine.tool_calls.tools import FunctionDefinition, ToolCall

START, END = "<tool_call>", "</tool_call>"
SYNTAX = JsonCallSyntax(opener=START, header=re.compile(CALL), after=re.compile(r"\s*\}\s*" + re.escape(END)))
INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class Hermes(ToolFormat):
    name = "hermes"
    trigger = START
    separator = "\n"

    def call_tag(self, function: FunctionDefinition) -> dict:
        return {"type": "tag", "begin": f'{START}\n{{"name": "{function.name}", "arguments": ',
                "content": json_schema_content(function), "end": f"}}\n{END}"}

    def stream(self) -> JsonCallStream:
        return JsonCallStream(SYNTAX)

    def instructions(self, tools_json: list[str]) -> str:
        return INSTRUCTIONS.format(tools="\n".join(tools_json))

    def calls_text(self, calls: list[ToolCall]) -> str:
        return self.separator.join(
            f'{START}\n{{"name": "{c.function.name}", "arguments": {c.function.arguments}}}\n{END}' for c in calls)

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
