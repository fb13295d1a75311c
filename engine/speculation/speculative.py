"""Speculative decoding's seam into the engine step: drafts before scheduling, statistics after the step.

Before the scheduler runs, every request in decode that may speculate gets up to k drafted tokens in
`spec_token_ids` (a model proposer fills them in after scheduling, see `model_proposers.py`); the scheduler counts them against the token budget (trimming them when it runs short),
the runner computes them in the same pass as everything else and verifies them (`rejection_sampler`),
and the scheduler rolls back over the rejected ones. Requests whose next token depends on more than the
target's logits (penalties, logit_bias, min_tokens, a structured-output grammar) are not speculated on.
"""

from dataclasses import dataclass, field


from kvloom.engine.config import SpeculativeConfig
from kvloom.engine.model.decoder import FusedDecoder
from kvloom.engine.errors import ConfigError
from kvloom.engine.model.model_loader import LoadedModel, load_model
from kvloom.engine.speculation.model_proposers import (DraftModelProposer, LayerSkipProposer, Proposer,
                                           check_draft_vocabulary)
from kvloom.engine.speculation.ngram_proposer import NgramProposer
from kvloom.engine.request import Request
from kvloom.engine.runner import allocate_kv_cache


@dataclass
class SpecDecodeStats:
    """vLLM's counters: drafts are requests that got drafted tokens in a step."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per request: the kept drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts added after `earlier` was taken (a copy of these stats at that time)."""
        return SpecDecodeStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                               self.num_accepted_tokens - earlier.num_accepted_tokens,
                               [a - b for a, b in zip(self.num_accepted_tokens_per_pos,
                                                      earlier.num_accepted_tokens_per_pos)])


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: list[Request]) -> None:
        """Before scheduling: drafts (or placeholders for them) for the running requests that may take some."""
        self.proposer.forget(running)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        for request in running:
            k = self._room(request)
            if k > 0:
                request.spec_token_ids = self.proposer.propose(request, k)

    def draft(self, scheduled: list[tuple[Request, int]]) -> None:
        """After scheduling: model proposers fill in the drafts the scheduler kept."""
        self.proposer.draft([r for r, _ in scheduled])

    def _room(self, request: Request) -> int:
        """Drafts this request may take: 0 unless it is decoding plainly; never past max_tokens or the context."""
        if (request.num_tokens - request.num_computed_tokens != 1 or request.logits_adjuster is not None
                or request.grammar is not None):
            return 0
        params = request.sampling_params
        # a step yields the kept drafts plus one more token
        return min(self.config.num_speculative_tokens, params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)

    def record(self, scheduled: list[tuple[Request, int]], new_tokens: dict[str, list]) -> None:
        """Count drafts and kept drafts of a verified step (before the scheduler clears the drafts)."""
        for request, _ in scheduled:
            drafted = len(request.spec_token_ids)
            if not drafted or request.request_id not in new_tokens:
                continue
            accepted = len(new_tokens[request.request_id]) - 1
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += drafted
            self.stats.num_accepted_tokens += accepted
            for position in range(accepted):
                self.stats.num_accepted_tokens_per_pos[position] += 1


def build_speculator(config: SpeculativeConfig, engine) -> Speculator:
    """The speculator for `engine` (an LLMEngine with its model, runner and cache set up)."""
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "layer_skip":
        proposer = _layer_skip(config, engine)
    else:
        proposer = _draft_model(engine)
    return Speculator(config, engine.max_model_len, proposer)


def _layer_skip(config: SpeculativeConfig, engine) -> LayerSkipProposer:
    if not isinstance(engine.decoder, FusedDecoder):
        raise ConfigError("speculative_config.method",
                          "layer_skip drafts with kvloom's fused decoder, which does not run this model")
    num_layers = engine.model_config.num_hidden_layers
    if config.draft_layers >= num_layers:
        raise ConfigError("speculative_config.draft_layers",
                          f"is {config.draft_layers}; the target has {num_layers} layers, so at most {num_layers - 1}")
    runner = engine.runner
    return LayerSkipProposer(engine.decoder, runner.kv_caches, runner.backend, engine.block_size, engine.device,
                             config.draft_layers)


def load_draft(config: SpeculativeConfig, engine) -> LoadedModel:
    """A draft model's checkpoint, checked against the target's vocabulary and context. The engine loads it
    before sizing its KV cache, so the draft's weights count in a CUDA memory profile and its KV in the budget."""
    draft = load_model(config.model, engine.dtype, engine.device, engine.config.model_impl)
    check_draft_vocabulary(engine.tokenizer, draft.tokenizer, engine.vocab_size, draft.config.vocab_size)
    if draft.config.max_position_embeddings < engine.max_model_len:
        raise ConfigError("speculative_config.model",
                          f"the draft's context ({draft.config.max_position_embeddings} tokens) is shorter than "
                          f"max_model_len ({engine.max_model_len})")
    return draft


def _draft_model(engine) -> DraftModelProposer:
    """The draft's own paged cache: as many blocks as the target's (the budget paid for both)."""
    draft = engine.draft
    shape = (engine.num_blocks, engine.block_size, draft.config.num_key_value_heads, draft.config.head_dim)
    caches = [(allocate_kv_cache(shape, engine.kv_dtype, engine.device),
               allocate_kv_cache(shape, engine.kv_dtype, engine.device))
              for _ in range(draft.config.num_hidden_layers)]
    return DraftModelProposer(draft.decoder, caches, engine.runner.backend, engine.block_size, engine.device,
                              engine.config.max_num_batched_tokens)
