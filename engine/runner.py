"""ModelRunner: owns the model and the paged KV cache; turns a scheduled step into sampled tokens.

A step is one flattened sequence of every scheduled request's new tokens (no padding): positions,
slot mapping and block tables come from the requests' progress, the decoder (kvloom's fused one, or
the stock model with paged attention plugged in) runs it, and only the rows that end a request's
known tokens reach the LM head.
"""

import torch

from kvloom.engine.block_table import BlockTable
from kvloom.engine.cuda_graphs import DecodeGraphs
from kvloom.engine.model.attention import ForwardContext
from kvloom.engine.model.decoder import FusedDecoder
from kvloom.engine.host_memory import advise_huge_pages
from kvloom.engine.lora.lora_step import LoRAStep
from kvloom.engine.lora.adapter_slots import AdapterSlots
from kvloom.engine.lora.registry import LoRARegistry
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.speculation.rejection_sampler import verify
from kvloom.engine.request import Request
from kvloom.engine.prompt_logprobs import PromptLogprobRows, prompt_rows
from kvloom.engine.sampler import SampledToken, sample
from kvloom.engine.step_plan import HostStaging, StepInputs
from kvloom.engine.model.stock_decoder import StockDecoder
from kvloom.kernels.backends import AttentionBackend
from kvloom.kernels.item_pool import use_item_pool


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V cache, zeroed (every page faulted in now, not inside a decode step).

    On CPU it asks for transparent huge pages first: decode attention reads scattered blocks, and
    with 4 KB pages nearly every block costs TLB misses (~8% of the kernel, measured).
    """
    cache = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(cache)
    return cache.zero_()


def by_adapter(scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """The step's requests with each LoRA adapter's together (base first), otherwise in their order: each
    adapter's rows are then one segment (engine/lora/lora_step.py)."""
    return sorted(scheduled, key=lambda item: item[0].lora.name if item[0].lora is not None else "")


class ModelRunner:
    def __init__(
        self, decoder: FusedDecoder | StockDecoder, config: ModelConfig, backend: AttentionBackend,
        num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device,
    ) -> None:
        """`config`: the model as this runner's decoder sees it (a tensor-parallel rank's KV heads only)."""
        self.decoder = decoder
        if device.type == "cpu":
            use_item_pool(isinstance(decoder, FusedDecoder) and decoder.runs_on_own_kernels())
        self.backend = backend
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            (allocate_kv_cache(shape, kv_dtype, device), allocate_kv_cache(shape, kv_dtype, device))
            for _ in range(config.num_hidden_layers)
        ]
        self.graphs: DecodeGraphs | None = None  # see capture_graphs
        self.staging = HostStaging(device)  # each step's inputs: one packed host buffer, one copy
        self.block_table = BlockTable()  # the running requests' block tables, kept from step to step
        self.adapters: LoRARegistry | None = None  # set where LoRA adapters are served
        self.adapter_slots: AdapterSlots | None = None  # and on CUDA, their slot buffers

    def check_health(self) -> None:
        """Raises if a part of this runner outside the process died (see TensorParallelRunner)."""

    def shutdown(self) -> None:
        """Releases what lives outside the process (see TensorParallelRunner)."""

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks' K and V in every layer (a fork's partial block: see KVCacheManager.fork)."""
        if not copies:
            return
        source = torch.tensor([s for s, _ in copies], device=self.device)
        target = torch.tensor([t for _, t in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache.index_copy_(0, target, key_cache.index_select(0, source))
            value_cache.index_copy_(0, target, value_cache.index_select(0, source))

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """These blocks' K and V in every layer, every KV head: [layers, 2, blocks, block_size, kv_heads, head_dim]."""
        index = torch.tensor(block_ids, device=self.device)
        return torch.stack([torch.stack([k.index_select(0, index), v.index_select(0, index)])
                            for k, v in self.kv_caches])

    @torch.inference_mode()
    def import_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Write `export_blocks`' form into these blocks."""
        index = torch.tensor(block_ids, device=self.device)
        for (key_cache, value_cache), layer in zip(self.kv_caches, payload.to(self.device)):
            key_cache.index_copy_(0, index, layer[0])
            value_cache.index_copy_(0, index, layer[1])

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, list[SampledToken]]:
        """Run one step; returns the new tokens of each request whose known tokens are all computed: one,
        or with drafted tokens (`spec_token_ids`, computed in this step too) those kept and the next."""
        inputs, sample_requests, for_prompts = self.prepare(
            by_adapter(scheduled) if self.adapters is not None else scheduled)
        logits = self.forward(inputs)
        if for_prompts is not None and logits is not None:
            logits = for_prompts.take(logits)
        if not sample_requests:
            return {}
        if logits.shape[0] > len(sample_requests):
            tokens = verify(logits, sample_requests)
        else:
            tokens = [[token] for token in sample(logits, sample_requests)]
        return {r.request_id: t for r, t in zip(sample_requests, tokens)}

    def prepare(self, scheduled: list[tuple[Request, int]]
                ) -> tuple[StepInputs, list[Request], PromptLogprobRows | None]:
        """The step's flattened inputs, the requests sampled (in row order), and the rows kept for prompt logprobs."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        wanted_prompt_rows = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            wanted_prompt_rows += prompt_rows(request, len(input_ids), start, end)
            known = request.token_ids[start:end]
            input_ids.extend(known + request.spec_token_ids[: num_new - len(known)])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(request.block_ids)
            if end == request.num_tokens_with_spec:
                sample_rows.extend(range(len(input_ids) - 1 - len(request.spec_token_ids), len(input_ids)))
                sample_requests.append(request)
        plan = PromptLogprobRows.plan(sample_rows, wanted_prompt_rows, self.device)
        kept_rows = plan.kept_rows if plan is not None else sample_rows
        padded = self.block_table.step([request.request_id for request, _ in scheduled], tables)
        inputs = StepInputs.build(input_ids, positions, query_lens, seq_lens, tables, padded, kept_rows,
                                  self.block_size, self.staging)
        if self.adapters is not None and any(request.lora is not None for request, _ in scheduled):
            rows = [(n, self.adapters.weights(r.lora) if r.lora is not None else None) for r, n in scheduled]
            inputs.lora = (self.adapter_slots.step(rows, kept_rows) if self.adapter_slots is not None
                           else LoRAStep.of_rows(rows, kept_rows))
        return inputs, sample_requests, plan

    def capture_graphs(self, max_num_seqs: int, max_blocks: int) -> DecodeGraphs:
        """CUDA graphs for plain decode steps up to `max_num_seqs` requests of up to `max_blocks` blocks."""
        self.graphs = DecodeGraphs(self.decoder, self.kv_caches, self.backend, max_num_seqs, max_blocks, self.device)
        self.graphs.capture()
        return self.graphs

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the sample rows (None when there are none, or on a tensor-parallel worker). A plain
        decode step without LoRA rows replays a CUDA graph where one was captured."""
        hidden = self.graphs.run(inputs) if self.graphs is not None and not inputs.lora else None
        if hidden is None:
            context = ForwardContext(inputs.meta, self.kv_caches, self.backend, inputs.lora)
            hidden = self.decoder(inputs.input_ids, inputs.positions, context, keep_rows=inputs.sample_rows)
        if not len(inputs.sample_rows):
            return None
        return self.decoder.logits(hidden)
