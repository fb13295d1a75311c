"""The tool-call formats kvloom speaks, by vLLM's `tool_call_parser` names, and which one a model gets.

`auto` (the default) reads the model's chat template: a template that writes `<tool_call>` is Hermes's, one that
writes `[TOOL_CALLS]` Mistral's, one that asks for `[func_name(...)]` pythonic, one with Llama 3's `"parameters"`
JSON (or its ipython role) Llama 3's; a template that takes no tools at all (SmolLM2's) gets the Hermes fallback
(tools in the system turn, conversation.py).
"""

import re

from kvloom.engine.tool_calls.hermes import Hermes
from kvloom.engine.tool_calls.llama3_json import Llama3Json
from kvloom.engine.tool_calls.mistral import Mistral
from kvloom.engine.tool_calls.pythonic import Pythonic
from kvloom.engine.tool_calls.tool_format import ToolFormat

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Pythonic())}
TOOL_CALL_PARSERS = ("auto", *FORMATS)
SIGNS = [  # what in a template's source tells its format, checked in this order
    ("mistral", re.compile(re.escape("[TOOL_CALLS]"))),
    ("hermes", re.compile(re.escape("<tool_call>"))),
    ("pythonic", re.compile(r"\[func_name\d?\(")),
    ("llama3_json", re.compile(r'"parameters"|<\|python_tag\|>|ipython')),
]


def tool_format(parser: str = "auto", template_source: str | None = None) -> ToolFormat:
    """The format `parser` names, or (auto) the one the template speaks."""
    if parser != "auto":
        return FORMATS[parser]
    found = next((name for name, sign in SIGNS if template_source and sign.search(template_source)), "hermes")
    return FORMATS[found]
