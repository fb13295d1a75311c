"""OpenAI-compatible request bodies, with vLLM's extensions (top_k, min_tokens, repetition_penalty, ...).

Fields kvloom does not know follow vLLM: one that would change the output (see REFUSED_FIELDS, and
unsupported values of known ones) is a 400 naming the field, never silently ignored; any other
(client bookkeeping such as `metadata` or `store`, another server's extension) is accepted, and the
router logs its name once.
"""

import json
import re
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from kvloom.engine.config import ADAPTER_NAME
from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.sampling import SamplingParams, StructuredOutputs, truncated_prompt
from kvloom.engine.tool_calls.formats import FORMATS
from kvloom.engine.tool_calls.tool_format import ToolFormat
from kvloom.engine.tool_calls.tools import Tool, ToolCall, ToolChoice, ToolUse

# Fields of OpenAI's or vLLM's API that change what is generated and that kvloom does not implement.
REFUSED_FIELDS = {
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "use_beam_search": "beam search is not supported", "length_penalty": "beam search is not supported",
    "guided_grammar": "grammars are not supported (JSON schemas, regular expressions and choices are)",
    "guided_whitespace_pattern": "not supported", "guided_decoding_backend": "not supported",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
}
# Values of those fields (besides null) that ask for what kvloom does anyway: clients often send defaults.
DEFAULT_VALUES = {"use_beam_search": False, "modalities": ["text"]}


MAX_CHOICES = 64  # choices (prompts times n) in one request: beyond, send several requests
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # in a raw body: where such strings can come from


class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: a named schema the output must be valid against."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or JSON valid against a schema."""
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None


def _constraint(field: str, value: Any) -> dict[str, Any]:
    """A structured-output field's (validated) value as StructuredOutputs' arguments."""
    if field == "guided_json":
        return {"json_schema": _schema(value)}
    if field == "guided_regex":
        return {"regex": value}
    if field == "guided_choice":
        return {"choice": value}
    if field == "structured_outputs":
        given = {"json_schema" if k == "json_" else k: v for k, v in value if v is not None}
        if "json_schema" in given:
            given["json_schema"] = _schema(given["json_schema"])
        return given
    if value.type == "json_object":  # response_format
        return {"json_object": True}
    return {"json_schema": value.json_schema.schema_}


def _schema(value: dict | str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be an object")
    return value


class LenientBody(BaseModel):
    """Unknown fields are kept in `model_extra`, for the refuse-or-log decision above."""
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        return [prefix + name for name in (self.model_extra or {})]

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        refused = next((f for f in extra if f in REFUSED_FIELDS and extra[f] not in (None, DEFAULT_VALUES.get(f))), None)
        if refused is not None:
            raise UnsupportedFieldError(refused, REFUSED_FIELDS[refused])

    def ignored_fields(self) -> list[str]:
        """Unknown fields that were accepted (the router logs each name once)."""
        return self.unknown_fields()


class StreamOptions(LenientBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk (guidellm asks for it)


class UnsupportedFieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class _Common(LenientBody):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # 64-bit, as vLLM takes (choice j draws with seed + j)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = None  # OpenAI sends the token ids as JSON object keys (strings)
    user: str | None = None
    priority: int | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's logprob and top alternatives
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's: a prefix cache within the tenant's
    # vLLM's, as SamplingParams takes them (which checks them)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # -1: as many as leave room for max_tokens
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_ids_as_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            bad = [k for k in value if not str(k).lstrip("-").isdigit()]
            if bad:
                raise ValueError(f"keys must be token ids, got {bad[0]!r}")
            return {int(k): v for k, v in value.items()}
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "only allowed with stream: true")
        self.output_constraint()

    def output_constraint(self) -> StructuredOutputs | None:
        """The one structured-output constraint the request asks for, from whichever field carries it."""
        asked = {name: value for name in STRUCTURED_FIELDS if (value := getattr(self, name)) is not None}
        if self.response_format is not None and self.response_format.type == "text":  # OpenAI's default
            del asked["response_format"]
        if len(asked) > 1:
            raise UnsupportedFieldError(sorted(asked)[1], f"give one of {', '.join(sorted(asked))}, not several")
        if not asked:
            return None
        (name, value), = asked.items()
        try:
            return StructuredOutputs(field=name, **_constraint(name, value))
        except ValidationError as exc:
            raise UnsupportedFieldError(name, exc.errors()[0]["msg"]) from None
        except (ValueError, TypeError) as exc:
            raise UnsupportedFieldError(name, str(exc)) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        """The engine's parameters for one choice: a seeded request's j-th choice draws with seed + j."""
        return SamplingParams(structured_outputs=self.output_constraint(),
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=None if self.seed is None else self.seed + seed_offset, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias or {},
            prompt_logprobs=self.wanted_prompt_logprobs() if seed_offset == 0 else None,  # later choices fork its KV
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            bad_words=self.bad_words or [], allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    def truncated(self, token_ids: list[int], max_model_len: int, max_tokens: int | None) -> list[int]:
        """The prompt cut to truncate_prompt_tokens by the router already, so that quotas, routing and echo's logprobs
        see the prompt the engine runs (the engine cuts it the same way: engine/input_processor.py); -1 waits for a
        replica's max_model_len to be known (0 until then)."""
        return truncated_prompt(token_ids, self.truncate_prompt_tokens, max_model_len - (max_tokens or 1))

    def wanted_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise UnsupportedFieldError("best_of", f"is {self.best_of}; it must be at least n ({self.n})")
        if self.candidates > self.n and self.stream:
            raise UnsupportedFieldError("best_of", "best_of above n cannot be streamed (as in OpenAI's API)")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported")
        self.prompts()

    def truncated(self, token_ids: list[int], max_model_len: int, max_tokens: int | None) -> list[int]:
        """The prompt cut to truncate_prompt_tokens by the router already, so that quotas, routing and echo's logprobs
        see the prompt the engine runs (the engine cuts it the same way: engine/input_processor.py); -1 waits for a
        replica's max_model_len to be known (0 until then)."""
        return truncated_prompt(token_ids, self.truncate_prompt_tokens, max_model_len - (max_tokens or 1))

    def wanted_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` shows the prompt's logprobs too."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None

    @property
    def candidates(self) -> int:
        """Generations per prompt: `best_of` of them, of which the `n` most likely are returned."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """One or several prompts (OpenAI: a string, token ids, or a list of either); each is a choice."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) * self.candidates > MAX_CHOICES:
                raise UnsupportedFieldError("prompt", f"at most {MAX_CHOICES} generations (prompts times "
                                                      "best_of or n) per request")
            return prompt
        return [prompt]


class TextPart(BaseModel):
    """A chat message's content part: text only (images and audio are refused by type)."""
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a message's unknown field could be content: refused
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only calls tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers

    @model_validator(mode="after")
    def _content_where_needed(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _parts_of_a_known_type(cls, content: Any) -> Any:
        """One error naming the part at fault, not one per branch of the union."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or a list of text parts")
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i}: content part type {kind!r} is not supported (text is)")
            try:
                parts.append(TextPart.model_validate(part))
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(f"part {i}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        return parts

    def as_template_entry(self) -> dict:
        """The message as OpenAI sends it, its content as one text (tool_calls/conversation.py renders it)."""
        entry = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            entry["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        return entry

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _tool_format: ToolFormat = PrivateAttr(default_factory=lambda: FORMATS["hermes"])

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @model_validator(mode="after")
    def _server_tool_format(self, info: ValidationInfo) -> "ChatCompletionRequest":
        """The server's tool-call format, given as validation context (`{"tool_format": ...}`)."""
        if info.context and "tool_format" in info.context:
            self._tool_format = info.context["tool_format"]
        return self

    @property
    def tool_format(self) -> ToolFormat:
        return self._tool_format

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_use() is not None and self.output_constraint() is not None:
            raise UnsupportedFieldError("tool_choice", "tools cannot be called under a structured-output constraint")
        self.conversation()

    @property
    def top_n(self) -> int | None:
        """Alternatives a generated token's logprobs list (None: no logprobs asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self) -> ToolUse | None:
        try:
            return self._tool_format.tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidRequestError as exc:
            raise UnsupportedFieldError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None

    def conversation(self) -> list[dict]:
        return [m.as_template_entry() for m in self.messages]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, seed_offset)
        if (use := self.tool_use()) is None:
            return params
        return params.model_copy(update={"structured_outputs": StructuredOutputs(
            structural_tag=self._tool_format.structural_tag(use), field="tools")})


class TokenizeRequest(LenientBody):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        self.conversation()

    def conversation(self) -> list[dict]:
        return [m.as_template_entry() for m in self.messages or ()]


class DetokenizeRequest(LenientBody):
    model: str | None = None
    tokens: list[int]


class LoadAdapterRequest(LenientBody):
    """vLLM's POST /v1/load_lora_adapter."""
    model: str | None = None  # unused: present so that the router's model check applies alike
    lora_name: str = Field(pattern=ADAPTER_NAME)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(LenientBody):
    """vLLM's POST /v1/unload_lora_adapter."""
    model: str | None = None
    lora_name: str
