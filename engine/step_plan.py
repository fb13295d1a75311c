"""What one forward pass needs, and its compact form for the other ranks of a tensor-parallel replica.

The driver's runner builds `StepInputs` from the scheduled requests; under tensor parallelism it broadcasts them
as one fixed header and one int64 body (token ids, positions, slot mapping, query starts, sequence lengths,
block tables, LM-head rows), so a worker runs the same forward with no scheduler, no requests and no Python
RPC: two broadcasts a step, whatever the batch.
"""

from dataclasses import dataclass

import torch

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

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, body): header = op, T, B, table width, S, body length."""
        meta = self.meta
        parts = [self.input_ids, self.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                 meta.block_tables.flatten(), self.sample_rows]
        body = torch.cat([p.to(torch.int64) for p in parts])
        header = torch.tensor([Op.STEP, len(self.input_ids), meta.num_seqs, meta.block_tables.shape[1],
                               len(self.sample_rows), len(body)], dtype=torch.int64)
        return header, body

    @staticmethod
    def decode(header: list[int], body: torch.Tensor, device: torch.device) -> "StepInputs":
        _, tokens, seqs, width, samples, _ = header
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, samples]
        ids, positions, slots, starts, seq_lens, tables, rows = body.to(device).split(sizes)
        starts_host, seq_lens_host = starts.tolist(), seq_lens.tolist()
        query_lens = [b - a for a, b in zip(starts_host, starts_host[1:])]
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.view(seqs, width).to(torch.int32), query_lens=query_lens,
            seq_lens_host=seq_lens_host, max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens_host, default=0))
        return StepInputs(ids, positions, meta, rows)


def control_header(op: int, body_len: int = 0) -> torch.Tensor:
    """A header with no step: stop, keep-alive, block copies (sources then targets in the body), a KV export or
    import (block ids in the body)."""
    return torch.tensor([op, 0, 0, 0, 0, body_len], dtype=torch.int64)
