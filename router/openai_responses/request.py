"""A Responses API request, validated where it arrives (errors name its own fields: `input.2.content`), and the
chat completion request it runs as: `instructions` as the system turn, the history of a previous response before
`input`, input items as messages (function calls as an assistant's `tool_calls`, their outputs as `tool`
messages), function tools in the chat shape, `text.format` as `response_format`."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvloom.router.protocol import LenientBody, UnsupportedFieldError


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # output_text's, sent back as the client got them


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")  # id, status: sent back as the client got them

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                          "function_call_output": FunctionCallOutputItem}


class FunctionTool(BaseModel):
    """A Responses function tool: the chat shape's `function` flattened into the tool."""
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is given with type json_schema, and only then")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesRequest(LenientBody):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False  # answer at once, generate on; GET polls it, POST .../cancel stops it
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: int | None = None  # kvloom's

    @field_validator("input", mode="before")
    @classmethod
    def _items_of_a_known_type(cls, value: Any) -> Any:
        """One error naming the item at fault (a message item may leave out its type), not one per union branch."""
        if not isinstance(value, list):
            return value
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if not isinstance(kind, str) or kind not in ITEM_TYPES:
                raise ValueError(f"item {i}: type {kind!r} is not supported ({', '.join(ITEM_TYPES)} are)")
            try:
                items.append(ITEM_TYPES[kind].model_validate(item))
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(f"item {i}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        return items

    def input_items(self) -> list[InputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def check_supported(self) -> None:
        super().check_supported()
        if self.background and (self.stream or not self.store):
            raise UnsupportedFieldError("background", "a background response is stored (store: true) and polled, "
                                                      "not streamed (stream: false)")

    def conversation(self, history: list[dict]) -> list[dict]:
        """The messages so far: `history` (a previous response's conversation), then this input. `instructions` are
        not part of it: a response continuing this one gives its own, as OpenAI's do."""
        return history + items_as_messages(self.input_items())

    def chat_body(self, conversation: list[dict]) -> dict:
        """The chat completion request this one runs as."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += conversation
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature,
                                "top_p": self.top_p, "stream": self.stream}
        optional = {"max_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls,
                    "user": self.user, "priority": self.priority,
                    "tools": [t.as_chat() for t in self.tools] if self.tools else None,
                    "tool_choice": ({"type": "function", "function": {"name": self.tool_choice.name}}
                                    if isinstance(self.tool_choice, NamedFunction) else self.tool_choice),
                    "response_format": self.response_format()}
        return {**body, **{k: v for k, v in optional.items() if v is not None}}

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_,
                                                       "strict": fmt.strict}}


def items_as_messages(items: list[InputItem]) -> list[dict]:
    """Input items as chat messages: consecutive function calls join one assistant turn."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages
