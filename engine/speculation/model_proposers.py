"""Drafting with a model: the target's own first layers (layer skip) or a smaller checkpoint (draft model).

Both run after scheduling, k passes over the scheduled requests that have drafts: pass j feeds each one
the token at position T-1+j (its last known token, then its drafts so far) and draws draft j from the
draft's logits, greedily for greedy requests, else from the draft's distribution q, which is kept for
rejection sampling. The scheduler counted the k drafts and gave them slots before any of this ran, so
the proposers only say "k drafts" before scheduling and fill them in here.

Layer skip runs the target's first N layers, then its final norm and LM head. Those layers' KV for the
verified tokens is exactly what the draft would compute, so it attends over the target's own cache and
writes its drafts' K/V into the slots the target writes in the same step: no second cache, no catch-up,
and the target overwrites every slot the draft touched before reading it.

A draft model keeps a paged cache of its own (as many blocks as the target's, no prefix caching): before pass
0 it is fed whatever it has not seen of the request (the prompt the first time, the kept tokens after a
verification), at most `max_pass_tokens` tokens a forward (a whole prompt, or a long prefix-cache hit, in one
forward would be a step of any size: the CUDA budget counts a draft pass of `max_num_batched_tokens`), and after
verification it rolls back to the tokens that were kept.
"""

from dataclasses import dataclass, field

import torch

from kvloom.engine.model.attention import ForwardContext
from kvloom.engine.block_pool import BlockPool, KVBlock
from kvloom.engine.errors import ConfigError
from kvloom.engine.request import Request
from kvloom.engine.counter_draws import Lane, uniform
from kvloom.engine.sampler import draw, sampling_probs
from kvloom.kernels.backends import AttentionBackend
from kvloom.kernels.metadata import AttentionMetadata


class Proposer:
    """Before scheduling, `propose` returns up to k drafts (or k placeholders that `draft` fills after it)."""

    def propose(self, request: Request, k: int) -> list[int]:
        raise NotImplementedError

    def draft(self, requests: list[Request]) -> None:
        """Fill the placeholders of the scheduled requests' drafts (proposers that need the step's slots)."""

    def forget(self, running: list[Request]) -> None:
        """Drop what is kept for requests no longer running."""


class ModelProposer(Proposer):
    def __init__(self, decoder, kv_caches: list, backend: AttentionBackend, block_size: int,
                 device: torch.device, num_layers: int | None = None) -> None:
        self.decoder, self.kv_caches, self.backend = decoder, kv_caches, backend
        self.block_size, self.device, self.num_layers = block_size, device, num_layers

    def propose(self, request: Request, k: int) -> list[int]:
        return [0] * k

    def first_position(self, request: Request) -> int:
        """The first position pass 0 feeds: the draft's KV holds everything before it."""
        return request.num_computed_tokens

    def block_table(self, request: Request) -> list[int]:
        return request.block_ids

    @torch.inference_mode()
    def draft(self, requests: list[Request]) -> None:
        requests = [r for r in requests if r.spec_token_ids]
        self.catch_up(requests)
        draft_probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        for j in range(max((len(r.spec_token_ids) for r in requests), default=0)):
            active = [r for r in requests if len(r.spec_token_ids) > j]
            input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
            for r in active:
                end = r.num_tokens + j  # positions first..end-1; the last one is new in every pass
                first = self.first_position(r) if j == 0 else end - 1
                input_ids.extend((r.token_ids + r.spec_token_ids[:j])[first:end])
                positions.extend(range(first, end))
                query_lens.append(end - first)
                seq_lens.append(end)
                tables.append(self.block_table(r))
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
            context = ForwardContext(meta, self.kv_caches, self.backend)
            ids = torch.tensor(input_ids, device=self.device)
            pos = torch.tensor(positions, device=self.device)
            last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
            logits = self.decoder.logits(self.forward(ids, pos, context, last_rows))
            greedy_tokens = logits.max(dim=-1).indices.tolist()
            for row, r in enumerate(active):
                params = r.sampling_params
                if params.greedy:
                    r.spec_token_ids[j] = greedy_tokens[row]
                    continue
                q = sampling_probs(logits[row].float(), params)
                r.spec_token_ids[j] = draw(q, uniform(r.draw_seed, r.num_output_tokens + j, Lane.DRAFT))
                draft_probs[r.request_id].append(q)
        for r in requests:
            if draft_probs[r.request_id]:
                r.spec_probs = torch.stack(draft_probs[r.request_id])
        self.drafted(requests)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                keep_rows: torch.Tensor) -> torch.Tensor:
        return self.decoder(ids, positions, context, num_layers=self.num_layers, keep_rows=keep_rows)

    def drafted(self, requests: list[Request]) -> None:
        """After the passes: what the draft's own cache now holds."""

    def catch_up(self, requests: list[Request]) -> None:
        """Before the passes: bring the draft's own cache up to all but the last known token (a draft model's)."""


class LayerSkipProposer(ModelProposer):
    """The target's first `num_layers` layers draft, over the target's own KV cache."""


@dataclass
class DraftSequence:
    blocks: list[KVBlock] = field(default_factory=list)
    computed: int = 0  # positions whose draft KV is valid


class DraftModelProposer(ModelProposer):
    """A separate checkpoint drafts, with its own paged KV cache kept in step with the target's tokens."""

    def __init__(self, decoder, kv_caches: list, backend: AttentionBackend, block_size: int,
                 device: torch.device, max_pass_tokens: int) -> None:
        super().__init__(decoder, kv_caches, backend, block_size, device)
        self.pool = BlockPool(kv_caches[0][0].shape[0])
        self.sequences: dict[str, DraftSequence] = {}
        self.max_pass_tokens = max_pass_tokens

    def catch_up(self, requests: list[Request]) -> None:
        """Feed the tokens the draft has not seen but the last, at most `max_pass_tokens` a forward (no logits)."""
        behind = [r for r in requests if self.first_position(r) < r.num_tokens - 1]
        while behind:
            input_ids, positions, query_lens, seq_lens, tables, room = [], [], [], [], [], self.max_pass_tokens
            for r in behind:
                first = self.first_position(r)
                end = min(r.num_tokens - 1, first + room)
                if end <= first:
                    break
                input_ids += r.token_ids[first:end]
                positions += range(first, end)
                query_lens.append(end - first)
                seq_lens.append(end)
                tables.append(self.block_table(r))
                room -= end - first
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
            self.forward(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                         ForwardContext(meta, self.kv_caches, self.backend),
                         torch.zeros(0, dtype=torch.long, device=self.device))
            for r, end in zip(behind, seq_lens):
                self.sequences[r.request_id].computed = end
            behind = [r for r in behind if self.first_position(r) < r.num_tokens - 1]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                keep_rows: torch.Tensor) -> torch.Tensor:
        return self.decoder(ids, positions, context, keep_rows=keep_rows)

    def propose(self, request: Request, k: int) -> list[int]:
        """k placeholders once the draft's cache has room for every position the passes write, else none."""
        seq = self.sequences.setdefault(request.request_id, DraftSequence())
        seq.computed = min(seq.computed, request.num_computed_tokens)  # roll back to the kept tokens
        needed = -(-(request.num_tokens + k - 1) // self.block_size) - len(seq.blocks)
        if needed > self.pool.num_free:
            return []
        if needed > 0:
            seq.blocks.extend(self.pool.allocate(needed))
        return [0] * k

    def first_position(self, request: Request) -> int:
        return self.sequences[request.request_id].computed

    def block_table(self, request: Request) -> list[int]:
        return [b.block_id for b in self.sequences[request.request_id].blocks]

    def drafted(self, requests: list[Request]) -> None:
        for r in requests:  # the passes wrote positions up to that of the second-to-last draft
            self.sequences[r.request_id].computed = r.num_tokens + len(r.spec_token_ids) - 1

    def forget(self, running: list[Request]) -> None:
        live = {r.request_id for r in running}
        for request_id in [i for i in self.sequences if i not in live]:
            for block in reversed(self.sequences.pop(request_id).blocks):
                self.pool.release(block)


def check_draft_vocabulary(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """A draft must speak the target's tokens: the same vocabulary, id for id."""
    if target_vocab != draft_vocab or target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ConfigError("speculative_config.model",
                          f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's "
                          f"({target_vocab}); a draft model must share the target's tokenizer")
