"""How a request's tools and its history of calls reach the model's chat template.

A template that takes tools (its source uses `tools`) gets them as `tools`, and the history as OpenAI sends it
(a call's arguments parsed into an object, as Hugging Face templates expect). A template that takes none
(SmolLM2's) gets the fallback, in the server's tool-call format (Hermes unless `tool_call_parser` says otherwise):
the tools and the format described at the end of the system turn, each assistant turn's past calls written into
it as the model would have written them, and each run of tool results in one user turn (for Hermes, Qwen 2.5's
`<tool_response>` blocks).
"""

import json

from kvloom.engine.tool_calls.tool_format import ToolFormat
from kvloom.engine.tool_calls.tools import ToolCall, ToolUse


def takes_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in template_source


def template_messages(messages: list[dict], use: ToolUse | None, fmt: ToolFormat,
                      native: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages for the template, and its `tools` argument (None: none, or rendered into the messages).
    `messages` are OpenAI's: role, content, and an assistant's `tool_calls` (ToolCall or its dict) or a tool's
    `tool_call_id`."""
    if native:
        return [_native(m) for m in messages], use.function_dicts() if use else None
    rendered: list[dict] = []
    results = False  # the last rendered turn holds tool results
    for message in messages:
        if message["role"] == "tool":
            result = fmt.result_text(message.get("content") or "")
            if results:
                rendered[-1]["content"] += "\n" + result
            else:
                rendered.append({"role": "user", "content": result})
            results = True
            continue
        results = False
        if message.get("tool_calls"):
            calls = fmt.calls_text([ToolCall.model_validate(call) for call in message["tool_calls"]])
            rendered.append({"role": "assistant", "content": "\n".join(filter(None, [message.get("content"), calls]))})
        else:
            rendered.append({"role": message["role"], "content": message.get("content") or ""})
    if use is not None:
        block = fmt.system_block(use)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{block}"}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None


def _native(message: dict) -> dict:
    calls = [ToolCall.model_validate(call) for call in message.get("tool_calls") or ()]
    if not calls:
        return message
    return {**message, "tool_calls": [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": _as_object(c.function.arguments)}} for c in calls]}


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def chat_token_ids(tokenizer, messages: list[dict], fmt: ToolFormat, use: ToolUse | None = None,
                   add_generation_prompt: bool = True) -> list[int]:
    """A conversation rendered by the tokenizer's chat template, with the request's tools."""
    entries, tools = template_messages(messages, use, fmt, takes_tools(getattr(tokenizer, "chat_template", None)))
    return list(tokenizer.apply_chat_template(entries, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=False, tools=tools))
