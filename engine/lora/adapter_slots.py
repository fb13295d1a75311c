"""CUDA: the adapters a step computes, in stacked slot buffers, and their deltas by one Triton launch per GEMM.

Each fused linear of each layer has an A buffer [max_loras, in, R] and a B buffer [max_loras, R, out], R being
max_lora_rank times the linear's parts (q|k|v: three), allocated at start (before the KV budget is profiled, so
the budget leaves room for them). An adapter is copied into a free or least recently used slot, zero-padded: an
unpatched linear, or a lower rank, adds zeros. A step's segments then name slots, and each linear's shrink and
expand are one launch each over every adapter in the step (kernels/triton_lora.py). The CPU path
(engine/lora/lora_step.py) multiplies each adapter's own unpadded matrices instead.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvloom.engine.lora.adapter import FUSED_PARTS, LoRAAdapter, part_features
from kvloom.engine.lora.lora_step import LoRAStep, Segment
from kvloom.engine.model.model_config import ModelConfig


class AdapterSlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device = device
        self.buffers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(config.num_hidden_layers):
            layer = {}
            for linear, parts in FUSED_PARTS.items():
                features_in = part_features(config, parts[0])[0]
                features_out = sum(part_features(config, part)[1] for part in parts)
                rank = max_rank * len(parts)
                layer[linear] = (torch.zeros(max_loras, features_in, rank, dtype=dtype, device=device),
                                 torch.zeros(max_loras, rank, features_out, dtype=dtype, device=device))
            self.buffers.append(layer)
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter (cache root) -> slot, least recently used first

    def slot(self, adapter: LoRAAdapter) -> int:
        """The adapter's slot, copying it in if it holds none (into a free slot, or the least recently used one:
        a step holds at most max_loras adapters, and each one it uses becomes the most recent)."""
        if adapter.cache_root in self.slot_of:
            self.slot_of.move_to_end(adapter.cache_root)
            return self.slot_of[adapter.cache_root]
        slot = len(self.slot_of) if len(self.slot_of) < self.max_loras else self.slot_of.popitem(last=False)[1]
        for layer, pairs in zip(self.buffers, adapter.layers):
            for linear, (a, b) in layer.items():
                a[slot].zero_()
                b[slot].zero_()
                if (pair := pairs.get(linear)) is not None:
                    rank = pair.a.shape[0]
                    a[slot, :, :rank].copy_(pair.a.t(), non_blocking=True)
                    b[slot, :rank].copy_(pair.b, non_blocking=True)
        self.slot_of[adapter.cache_root] = slot
        return slot

    def step(self, row_adapters: list[tuple[int, LoRAAdapter | None]], sample_rows: list[int]) -> "SlottedLoRAStep":
        plain = LoRAStep.of_rows(row_adapters, sample_rows)
        return SlottedLoRAStep(self, SegmentTable.of(plain.segments, self), SegmentTable.of(plain.kept, self))


@dataclass(frozen=True)
class SegmentTable:
    """Segments as the kernel reads them: device tables of first and end rows and slots, and the longest."""
    starts: torch.Tensor
    ends: torch.Tensor
    slots: torch.Tensor
    longest: int

    @classmethod
    def of(cls, segments: tuple[Segment, ...], slots: AdapterSlots) -> "SegmentTable":
        columns = torch.tensor([[s.start for s in segments], [s.end for s in segments],
                                [slots.slot(s.adapter) for s in segments]], dtype=torch.int32)  # rows contiguous
        starts, ends, slot_ids = columns.to(slots.device, non_blocking=True)
        return cls(starts, ends, slot_ids, max((s.end - s.start for s in segments), default=0))


@dataclass(frozen=True)
class SlottedLoRAStep:
    """`LoRAStep`'s interface over slot buffers."""
    slots: AdapterSlots
    segments: SegmentTable
    kept: SegmentTable

    def __bool__(self) -> bool:
        return self.segments.longest > 0

    def kept_rows(self) -> "SlottedLoRAStep":
        return SlottedLoRAStep(self.slots, self.kept, self.kept)

    def add(self, layer: int, linear: str, x: torch.Tensor, y: torch.Tensor, first_row: int = 0) -> None:
        from kvloom.kernels.triton_lora import segmented_matmul

        a, b = self.slots.buffers[layer][linear]
        table = self.segments
        shrunk = torch.empty(x.shape[0], a.shape[2], dtype=x.dtype, device=x.device)
        segmented_matmul(x, a, shrunk, table.starts, table.ends, table.slots, table.longest, first_row)
        segmented_matmul(shrunk, b, y, table.starts, table.ends, table.slots, table.longest, first_row, accumulate=True)
