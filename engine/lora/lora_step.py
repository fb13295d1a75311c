"""One step's LoRA deltas on CPU: the rows of each adapter, and the segmented GEMMs that add their deltas (punica's
SGMV).

The runner orders a step's requests by adapter, so each adapter's rows are one contiguous segment, and a fused
linear's delta is `y[rows] += (x[rows] @ a.T) @ b` per adapter in the step, over views, with no gather. On CPU every
segment, decode rows and prompt chunks alike, goes to one C++ call per linear (kernels/cpu_lora.py), which reads each
adapter's weights once per few rows and skips the zero blocks of b (torch's GEMMs took twice the base model's time
on bfloat16 prompt chunks: docs/performance.md); other dtypes and devices use torch's GEMMs. The call takes the
step's table of its adapters' weights, stacked once a step: building each call's arguments in Python cost a
decode step ~3 ms (120 calls). Base rows belong to no
segment and cost nothing; a step without adapters holds none. CUDA: adapter_slots.py.
"""

import functools
from dataclasses import dataclass

import torch

from kvloom.engine.lora.adapter import FUSED_PARTS, LoRAAdapter
from kvloom.kernels.cpu_lora import lora_add_
LINEAR_INDEX = {linear: index for index, linear in enumerate(FUSED_PARTS)}  # a layer's fused linears in table order


@dataclass(frozen=True)
class Segment:
    start: int  # first row of the step
    end: int
    adapter: LoRAAdapter


@dataclass(frozen=True)
class LoRAStep:
    segments: tuple[Segment, ...] = ()
    kept: tuple[Segment, ...] = ()  # the same adapters over the rows the LM head reads (the last layer's only rows)

    @classmethod
    def of_rows(cls, row_adapters: list[tuple[int, LoRAAdapter | None]], sample_rows: list[int]) -> "LoRAStep":
        """From (row count, adapter) runs in row order; `sample_rows` ascending."""
        segments, kept, start, kept_start = [], [], 0, 0
        for count, adapter in row_adapters:
            end = start + count
            kept_end = kept_start + sum(1 for row in sample_rows if start <= row < end)
            if adapter is not None:
                _extend(segments, start, end, adapter)
                _extend(kept, kept_start, kept_end, adapter)
            start, kept_start = end, kept_end
        return cls(tuple(segments), tuple(kept))

    def __bool__(self) -> bool:
        return bool(self.segments)

    def kept_rows(self) -> "LoRAStep":
        """The deltas of the rows the LM head reads, renumbered from 0 (the last layer's o_proj and MLP)."""
        return LoRAStep(self.kept, self.kept)

    @functools.cached_property
    def op_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The segments as the C++ op reads them: their adapters' tables stacked, and their rows; None where the
        adapters were not laid out for it (another device or dtype: torch's GEMMs)."""
        if any(segment.adapter.table is None for segment in self.segments):
            return None
        tables = torch.stack([segment.adapter.table for segment in self.segments])
        rows = torch.tensor([(segment.start, segment.end) for segment in self.segments], dtype=torch.int64)
        return tables, rows

    def add(self, layer: int, linear: str, x: torch.Tensor, y: torch.Tensor, first_row: int = 0) -> None:
        """y += the LoRA delta of `linear` for x's rows, which are the step's rows from `first_row` on."""
        if not self.segments:
            return
        if (op_tables := self.op_tables) is not None:
            tables, rows = op_tables
            lora_add_(y, x, tables, rows, layer * len(FUSED_PARTS) + LINEAR_INDEX[linear], first_row)
            return
        last_row = first_row + x.shape[0]
        for segment in self.segments:
            lo, hi = max(segment.start, first_row) - first_row, min(segment.end, last_row) - first_row
            pair = segment.adapter.layers[layer].get(linear)
            if lo >= hi or pair is None:
                continue
            shrunk = x[lo:hi] @ pair.a.t()
            for r0, r1, c0, c1 in pair.parts:  # the nonzero blocks of b only
                y[lo:hi, c0:c1].addmm_(shrunk[:, r0:r1], pair.b[r0:r1, c0:c1])


NO_LORA = LoRAStep()


def _extend(segments: list[Segment], start: int, end: int, adapter: LoRAAdapter) -> None:
    """Rows [start, end) of `adapter`: joined to the last segment where they continue it."""
    if start == end:
        return
    if segments and segments[-1].adapter is adapter and segments[-1].end == start:
        start = segments.pop().start
    segments.append(Segment(start, end, adapter))

