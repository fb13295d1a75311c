"""What a request asks of its tools, validated where it arrives: the tools (functions whose `parameters` must be a
JSON schema), the choice (`none`, `auto`, `required` or one named function) and whether calls may come several at
once. Errors name the request field at fault."""

from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvloom.engine.errors import InvalidRequestError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    strict: bool | None = None  # every call kvloom returns is constrained to its schema, strict or not

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a JSON schema: {exc.message}") from None
        return parameters


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant message of the history."""
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolUse:
    """How a request may call its tools: `auto` (text or calls), `required` (calls only), `named` (that one)."""

    tools: tuple[Tool, ...]  # all the request offers (the model sees them all)
    mode: Literal["auto", "required", "named"]
    parallel: bool = True
    name: str | None = None  # named: the function it must call

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools its output may call."""
        return tuple(t for t in self.tools if self.name in (None, t.function.name))

    def function_dicts(self) -> list[dict]:
        """The tools as a chat template's `tools` takes them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def tool_use(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolUse | None:
    """The request's tool use, or None when it calls none (no tools, or `tool_choice: none`)."""
    if isinstance(choice, NamedToolChoice):
        if not tools or choice.function.name not in {t.function.name for t in tools}:
            raise InvalidRequestError("tool_choice", f"names function {choice.function.name!r}, which is not in tools")
        return ToolUse(tuple(tools), "named", parallel=False, name=choice.function.name)
    if choice == "required" and not tools:
        raise InvalidRequestError("tool_choice", "required needs at least one tool")
    if not tools or choice == "none":
        return None
    return ToolUse(tuple(tools), choice or "auto", parallel is not False)


def parse_tools(raw: list) -> list[Tool]:
    """`tools` as given to the offline LLM (OpenAI's dicts), validated as the server validates them."""
    return [_validated(Tool, tool, f"tools.{i}") for i, tool in enumerate(raw)]


def parse_tool_choice(raw: str | dict | None) -> ToolChoice | None:
    if raw is None or raw in ("none", "auto", "required"):
        return raw
    return _validated(NamedToolChoice, raw, "tool_choice")


def _validated(model: type[BaseModel], raw, field: str):
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequestError(".".join([field, *map(str, first["loc"])]), first["msg"]) from None
