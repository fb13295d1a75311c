"""CUDA graphs of decode steps: captured once at start for a ladder of batch sizes up to `max_num_seqs`, then
replayed with the step's inputs copied into static buffers and padded to the next size up (the scheme of vLLM
and nano-vllm). A decode step of a small model is hundreds of kernel launches issued from Python; a replay is
one. A graph covers the decoder up to its final hidden states; the LM head runs after it, on the real rows only
(a graph's output is then a few KB a row, not a vocabulary's logits). Steps with a prefill chunk or drafted
tokens run eager, as does a batch above the ladder.

Padding rows read block 0's first slot (seq_len 1), write nowhere (slot -1: `write_kv` skips it) and are
dropped from the logits; rows are independent in the decoder, so they change nothing of the real ones.
`enforce_eager` turns graphs off, and so does an attention backend that is not graph-safe (`captures_graphs`). The
Triton attention kernel reads sequence lengths from the device, so one graph serves every context length.
"""

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from kvloom.engine.model.attention import ForwardContext
from kvloom.engine.step_plan import StepInputs
from kvloom.kernels.backends import AttentionBackend
from kvloom.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def captures_graphs(device: torch.device, enforce_eager: bool, backend: AttentionBackend) -> bool:
    """Whether a (one-rank) engine captures decode graphs: on CUDA, unless `enforce_eager`, and only over a
    graph-safe attention backend (one log line says so where that alone keeps them off)."""
    if device.type != "cuda" or enforce_eager:
        return False
    if not backend.graph_safe:
        logger.info("CUDA graphs off: attention backend %r is not graph-safe (it reads sequence lengths on the "
                    "host); every step runs eager", backend.name)
    return backend.graph_safe


def graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below `max_num_seqs`, and `max_num_seqs` itself."""
    return sorted({size for size in (1, 2, 4) if size < max_num_seqs} | set(range(8, max_num_seqs, 8)) |
                  {max_num_seqs})


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch` rows (None: above the ladder, run eager)."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if batch > 0 and index < len(sizes) else None


def is_plain_decode(inputs: StepInputs) -> bool:
    """One new token per request and every row's logits wanted: the step a graph replays."""
    meta = inputs.meta
    return meta.max_query_len == 1 and len(inputs.input_ids) == meta.num_seqs == len(inputs.sample_rows)


@dataclass
class StaticDecodeInputs:
    """The buffers a graph reads, sized for the largest batch; a step's inputs are copied into their first rows."""
    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    seq_lens: torch.Tensor  # [rows] int32
    block_tables: torch.Tensor  # [rows, max_blocks] int32
    query_start_loc: torch.Tensor  # [rows + 1] int32: 0, 1, 2, ... (one query token a row, never rewritten)
    max_seq_len: int  # the longest context a graph serves (its split-KV decode sizes its segments by it)

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, block_size: int, device: torch.device) -> "StaticDecodeInputs":
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        # as padding rows until a step fills them: the capture's own runs write no KV anywhere
        return cls(zeros(rows), zeros(rows), zeros(rows) - 1, zeros(rows, dtype=torch.int32) + 1,
                   zeros(rows, max_blocks, dtype=torch.int32),
                   torch.arange(rows + 1, dtype=torch.int32, device=device), max_blocks * block_size)

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a `size`-row graph: views of the buffers, fixed host fields."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], query_lens=[1] * size,
            seq_lens_host=[1] * size, max_query_len=1, max_seq_len=self.max_seq_len)

    def fill(self, inputs: StepInputs, size: int) -> None:
        """Copy a plain decode step's inputs into rows 0..batch-1 and pad the rows up to `size`."""
        batch, meta = len(inputs.input_ids), inputs.meta
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks exceeds the graphs' {self.block_tables.shape[1]}")
        self.input_ids[:batch].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:batch].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        # padding rows: token 0 at position 0, reading block 0's first slot, writing nowhere
        self.input_ids[batch:size] = 0
        self.positions[batch:size] = 0
        self.slot_mapping[batch:size] = -1
        self.seq_lens[batch:size] = 1
        self.block_tables[batch:size] = 0


class DecodeGraphs:
    """A runner's decode graphs. `forward(input_ids, positions, context)` is its decoder: the final hidden
    states of every row."""

    def __init__(self, forward, kv_caches: list, backend, max_num_seqs: int, max_blocks: int,
                 device: torch.device) -> None:
        self.forward, self.kv_caches, self.backend = forward, kv_caches, backend
        self.sizes = graph_sizes(max_num_seqs)
        self.inputs = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks, kv_caches[0][0].shape[1], device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, its hidden states)
        self.memory_bytes = 0
        self.capture_s = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool (smaller graphs reuse the larger ones' memory)."""
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = None
        for size in reversed(self.sizes):
            context = ForwardContext(self.inputs.metadata(size), self.kv_caches, self.backend)
            ids, positions = self.inputs.input_ids[:size], self.inputs.positions[:size]
            run = lambda: self.forward(ids, positions, context)  # noqa: E731
            run()  # outside the graph: Triton compiles, the allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = run()
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_allocated() - before
        logger.info("captured %d decode graphs (batch %d..%d) in %.1f s; they hold %.0f MiB", len(self.sizes),
                    self.sizes[0], self.sizes[-1], self.capture_s, self.memory_bytes / 2**20)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's final hidden states from a replay (a view, valid until the next replay), or None where it
        runs eager (not a plain decode, or too big)."""
        if not is_plain_decode(inputs):
            return None
        size = padded_size(len(inputs.input_ids), self.sizes)
        if size is None or size not in self.graphs:
            return None
        self.inputs.fill(inputs, size)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[: len(inputs.input_ids)]
