"""A request's life inside one engine: its tokens, progress and the KV blocks it holds."""

import enum
import time
from dataclasses import dataclass, field

import torch

from kvloom.engine.cache_namespace import chain_root
from kvloom.engine.logits_processors import LogitsAdjuster
from kvloom.engine.lora.adapter import AdapterRef
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.structured_output import OutputGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # admitted, waiting for its prefix's blocks from a KV tier (engine/kv_tiers/tier_io.py)
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    park_kv: bool = False  # disaggregated prefill: keep the blocks after finishing, for a KV hand-off
    logits_adjuster: LogitsAdjuster | None = None  # penalties, logit_bias, min_tokens: None when none asked
    grammar: OutputGrammar | None = None  # structured outputs: the matcher of the output so far
    fork_of: str | None = None  # n > 1: the sibling whose prompt KV this one shares (Scheduler._fork_source)
    draw_seed: tuple[int, int] = (0, 0)  # its draws' seed words (counter_draws); the engine sets them
    lora: AdapterRef | None = None  # the LoRA adapter its rows run with (None: the base model)
    yields_prefill: bool = False  # its tenant is over its share: its prompt goes in small chunks (prefill_yield.py)
    cache_namespace: int | None = None  # whose prefix cache it reads and fills: its tenant's (engine/cache_namespace.py)

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)  # prompt followed by the generated tokens
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, dict[int, float]] | None] | None = None  # by position (prompt_logprobs.py)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_prompt_tokens: int = 0  # of those, how many came from the prefix cache
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks, in order
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens this step verifies
    spec_probs: torch.Tensor | None = None  # the draft's distribution per drafted token; None: a point mass
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def hash_root(self) -> int | None:
        """The parent of its first block's hash: its namespace's blocks only, and under an adapter that adapter's."""
        return chain_root(self.cache_namespace, self.lora.cache_root if self.lora is not None else None)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
