"""SamplingParams: what a caller may ask of one request, validated so bad input fails early."""

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per token")
    detokenize: bool = True

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
