"""SamplingParams: what a caller may ask of one request, validated so bad input fails early."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint on the output's text (see structured_output.py)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | None = None  # the output is JSON valid against this schema
    json_object: bool = False  # the output is any JSON object
    regex: str | None = None  # the output matches this regular expression
    choice: list[str] | None = None  # the output is one of these strings
    structural_tag: dict[str, Any] | None = None  # xgrammar's structural tag (tool calls: tool_calls/tool_format.py)
    field: str = "structured_outputs"  # the request field that asked for it, named in errors

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.structural_tag is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of json_schema, json_object, regex, choice and structural_tag")
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")
        return self


# vLLM's bounds on bad_words (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): each is checked every step
MAX_BAD_WORDS = 128  # words per request
MAX_BAD_WORD_TOKENS = 1024  # their token sequences' length, all together


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = Field(16, ge=1, description="None: as many as max_model_len leaves after the prompt")
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="the draws of its i-th token depend on (seed, i) alone")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="no EOS or stop token/string before this many tokens")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1 disables it")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> value in [-100, 100]")
    n: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per token")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="each prompt token's logprob and this many "
                                                                       "top alternatives (engine/prompt_logprobs.py)")
    detokenize: bool = True
    structured_outputs: StructuredOutputs | None = None
    # vLLM's
    include_stop_str_in_output: bool = Field(False, description="a stop string stays at the end of the text, and a "
                                                                "stop or EOS token's text too")
    skip_special_tokens: bool = Field(True, description="False: special tokens' text is in the output")
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS,
                                 description="never generated (its token sequences: InputProcessor.bad_word_sequences)")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="only these may be sampled")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the prompt's last this many tokens (-1: "
                                                                        "all that leave room for max_tokens)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1, or -1 (as many as fit)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {token} is outside [-100, 100]")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_within_max(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must not exceed max_tokens ({max_tokens})")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def truncated_prompt(token_ids: list[int], keep: int | None, room: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (left truncation; -1: `room` of them, what
    max_model_len leaves once max_tokens are set aside), the whole prompt where it is not longer."""
    keep = room if keep == -1 else keep
    return token_ids[-keep:] if keep is not None and 0 < keep < len(token_ids) else token_ids
