"""Attention metadata for one flattened batch.

A step packs every scheduled request's new tokens into one sequence of `T` tokens. Request `i`
owns query rows `query_start_loc[i]:query_start_loc[i+1]`; its KV lives in the paged cache at the
blocks listed in `block_tables[i]`, and after this step it holds `seq_lens[i]` tokens (cached
prefix + the new ones). Query row `j` of request `i` sits at absolute position
`seq_lens[i] - query_len_i + j` and attends causally to KV positions `<=` that.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (masked by seq_lens)
    query_lens: list[int]  # host copies, so CPU code never syncs on device tensors
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    derived: dict = field(default_factory=dict)  # per-step values a backend computes once for all layers

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @staticmethod
    def host_layout(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                    block_size: int) -> tuple[list[int], list[int]]:
        """(slot mapping, query start locations) as host lists."""
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return slots, starts

    @staticmethod
    def padded(block_tables: list[list[int]]) -> list[list[int]]:
        """The tables padded with 0 to the longest's width (at least one block)."""
        width = max((len(t) for t in block_tables), default=0) or 1
        return [t + [0] * (width - len(t)) for t in block_tables]

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Derive slot mapping and padded tables from per-request host lists."""
        slots, starts = AttentionMetadata.host_layout(query_lens, seq_lens, block_tables, block_size)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(AttentionMetadata.padded(block_tables), dtype=torch.int32, device=device),
            query_lens=list(query_lens),
            seq_lens_host=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
