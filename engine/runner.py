"""ModelRunner: owns the model and the paged KV cache; turns a scheduled step into sampled tokens.

A step is one flattened sequence of every scheduled request's new tokens (no padding): positions,
slot mapping and block tables come from the requests' progress, kvloom's fused decoder (or the
stock model with paged attention plugged in) runs it, and only the rows that end a request's known
tokens reach the LM head.
"""

import torch

from kvloom.engine.attention import ForwardContext
from kvloom.engine.decoder import FusedDecoder
from kvloom.engine.host_memory import advise_huge_pages
from kvloom.engine.request import Request
from kvloom.engine.sampler import SampledToken, sample
from kvloom.kernels.backends import AttentionBackend
from kvloom.kernels.metadata import AttentionMetadata


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_layer = 2 * hf_config.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8
    return per_layer * hf_config.num_hidden_layers


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V cache, zeroed (every page faulted in now, not inside a decode step).

    On CPU it asks for transparent huge pages first: decode attention reads scattered blocks, and
    with 4 KB pages nearly every block costs TLB misses (~8% of the kernel, measured).
    """
    cache = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(cache)
    return cache.zero_()


class ModelRunner:
    def __init__(
        self, model, backend: AttentionBackend, num_blocks: int, block_size: int,
        kv_dtype: torch.dtype, device: torch.device, fused: FusedDecoder | None = None,
    ) -> None:
        """`fused`: kvloom's own forward over the model's weights; None runs the stock forward."""
        self.model = model
        self.fused = fused
        self.backend = backend
        self.block_size = block_size
        self.device = device
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (num_blocks, block_size, cfg.num_key_value_heads, head_dim)
        self.kv_caches = [
            (allocate_kv_cache(shape, kv_dtype, device), allocate_kv_cache(shape, kv_dtype, device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.decoder = model.base_model
        self.lm_head = model.get_output_embeddings()

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], generators: dict[str, torch.Generator]
    ) -> dict[str, SampledToken]:
        """Run one step; returns a sampled token for each request whose known tokens are all computed."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(request.block_ids)
            if end == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(request)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        context = ForwardContext(meta, self.kv_caches, self.backend)
        ids = torch.tensor(input_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        if self.fused is not None:
            hidden = self.fused(ids, pos, context)
        else:
            hidden = self.decoder(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                                  kvloom_context=context).last_hidden_state[0]
        if not sample_requests:
            return {}
        head = self.fused.logits if self.fused is not None else self.lm_head
        logits = head(hidden[sample_rows])
        tokens = sample(logits, sample_requests, [generators[r.request_id] for r in sample_requests])
        return {r.request_id: t for r, t in zip(sample_requests, tokens)}
