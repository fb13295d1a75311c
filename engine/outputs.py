"""What the engine hands back for a request after each step (cumulative and incremental views)."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    text: str  # all text so far
    token_ids: list[int]  # all generated tokens so far
    delta_text: str  # text new since the previous output for this request
    delta_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    priority: int = 0
    extra: dict = field(default_factory=dict)
    prompt_logprobs: list[tuple[int, dict[int, float]] | None] | None = None  # asked for: with the first token
    # and with the last (each a streamed output's chunk's, the other an offline caller's)
