"""OpenAI-compatible request bodies. Unknown fields and unsupported values are rejected by name.

A field we do not implement but that would change the output (n > 1, penalties, logit_bias,
tools, ...) is a 400 naming the field, never silently ignored.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvloom.engine.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class UnsupportedFieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise UnsupportedFieldError("n", "only n=1 is supported")
        if self.presence_penalty:
            raise UnsupportedFieldError("presence_penalty", "penalties are not supported")
        if self.frequency_penalty:
            raise UnsupportedFieldError("frequency_penalty", "penalties are not supported")
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "only allowed with stream: true")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedFieldError("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise UnsupportedFieldError("prompt", "send one prompt per request (batches are not supported)")
            prompt = prompt[0]
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise UnsupportedFieldError("messages.content", f"content part type {part.get('type')!r} is not supported")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise UnsupportedFieldError("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedFieldError("tool_choice", "tool calling is not supported")
        if self.response_format and self.response_format.get("type") != "text":
            raise UnsupportedFieldError("response_format", "only type 'text' is supported")

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
