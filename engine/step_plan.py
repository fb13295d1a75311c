"""What one forward pass needs, and its compact form for the other ranks of a tensor-parallel replica.

The driver's runner builds `StepInputs` from the scheduled requests; under tensor parallelism it broadcasts them
as one fixed header and one int64 body (token ids, positions, slot mapping, query starts, sequence lengths,
block tables, LM-head rows), so a worker runs the same forward with no scheduler, no requests and no Python
RPC: two broadcasts a step, whatever the batch.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvloom.engine.lora.lora_step import NO_LORA, LoRAStep
from kvloom.kernels.metadata import AttentionMetadata

HEADER_LEN = 6


class Op:
    """What a plan asks the workers to do."""
    STOP, STEP, COPY_BLOCKS, KEEPALIVE, EXPORT_KV, IMPORT_KV = 0, 1, 2, 3, 4, 5


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows whose logits are needed (empty: the LM head does not run)
    lora: LoRAStep = NO_LORA  # the rows' LoRA adapters (one device: tensor parallelism serves none)

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, body): header = op, T, B, table width, S, body length."""
        meta = self.meta
        parts = [self.input_ids, self.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                 meta.block_tables.flatten(), self.sample_rows]
        body = torch.cat([p.to(torch.int64) for p in parts])
        header = torch.tensor([Op.STEP, len(self.input_ids), meta.num_seqs, meta.block_tables.shape[1],
                               len(self.sample_rows), len(body)], dtype=torch.int64)
        return header, body

    @classmethod
    def build(cls, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
              tables: list[list[int]], padded_tables: np.ndarray, sample_rows: list[int], block_size: int,
              staging: "HostStaging") -> "StepInputs":
        """The step's inputs from host lists (`tables`: each request's blocks, for its slots) and its padded block
        tables ([requests, width], a `BlockTable`'s rows): packed into one int64 host buffer, one copy to the device
        (the body `encode` lays out)."""
        slots, starts = AttentionMetadata.host_layout(query_lens, seq_lens, tables, block_size)
        body = staging.to_device([[*input_ids, *positions, *slots, *starts, *seq_lens], padded_tables.ravel(),
                                  sample_rows])
        return cls._split(body, len(input_ids), len(query_lens), padded_tables.shape[1], len(sample_rows),
                          query_lens, seq_lens)

    @classmethod
    def decode(cls, header: list[int], body: torch.Tensor, device: torch.device) -> "StepInputs":
        _, tokens, seqs, width, samples, _ = header
        host = body[3 * tokens : 3 * tokens + 2 * seqs + 1].tolist()  # query starts and sequence lengths
        starts, seq_lens = host[: seqs + 1], host[seqs + 1 :]
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        return cls._split(body.to(device), tokens, seqs, width, samples, query_lens, seq_lens)

    @staticmethod
    def _split(body: torch.Tensor, tokens: int, seqs: int, width: int, samples: int, query_lens: list[int],
               seq_lens: list[int]) -> "StepInputs":
        """Views of a packed body (on its device), with the host copies of the lengths."""
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, samples]
        ids, positions, slots, starts, seq_lens_device, tables, rows = body.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts.to(torch.int32), seq_lens=seq_lens_device.to(torch.int32),
            block_tables=tables.view(seqs, width).to(torch.int32), query_lens=list(query_lens),
            seq_lens_host=list(seq_lens), max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0))
        return StepInputs(ids, positions, meta, rows)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`: on CUDA through pinned memory in a non-blocking copy (torch's caching host
    allocator keeps the pinned block until the copy is done), elsewhere the tensor itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices (int64) on `device` through `to_device`: never a blocking copy from pageable memory mid-step."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


class HostStaging:
    """The host buffer a step's inputs are packed into: pinned on CUDA and reused, grown when a step needs more,
    so each step is one non-blocking copy from memory the device can read directly. Before the buffer is
    rewritten, the previous copy out of it has finished (an event recorded after it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.int64)
        self.copied: torch.cuda.Event | None = None

    def to_device(self, parts: list[Sequence[int]]) -> torch.Tensor:
        """`parts` (lists or arrays of ints) end to end, as one int64 tensor on the device."""
        total = sum(len(part) for part in parts)
        if self.device.type != "cuda":
            return torch.from_numpy(_pack(np.empty(total, dtype=np.int64), parts))
        if total > len(self.buffer):
            self.buffer = torch.empty(max(total, 2 * len(self.buffer), 1024), dtype=torch.int64, pin_memory=True)
        if self.copied is not None:
            self.copied.synchronize()
        host = self.buffer[:total]
        _pack(host.numpy(), parts)
        on_device = host.to(self.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return on_device


def _pack(out: np.ndarray, parts: list[Sequence[int]]) -> np.ndarray:
    """`parts` written end to end into `out` (a copy: nothing of them is read after)."""
    start = 0
    for part in parts:
        out[start : start + len(part)] = part
        start += len(part)
    return out


def control_header(op: int, body_len: int = 0) -> torch.Tensor:
    """A header with no step: stop, keep-alive, block copies (sources then targets in the body), a KV export or
    import (block ids in the body)."""
    return torch.tensor([op, 0, 0, 0, 0, body_len], dtype=torch.int64)
