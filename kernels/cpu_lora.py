"""LoRA deltas of a step's small adapter segments on CPU: the C++ op (cpu_lora.cpp), float32 or bfloat16."""

import torch

from kvloom.kernels.cpu_extensions import build_extension


def lora_extension():
    return build_extension("kvloom_cpu_lora")


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], rows: list[int],
              parts: list[int]) -> None:
    """y[r] += (x[r] @ a[s]) @ b[s] for the rows r of each segment s (`rows`: first and end row per segment);
    `parts`: per segment, its part count, then each part's b rows and columns (r0, r1, c0, c1)."""
    lora_extension().lora_add_(y, x, a, b, rows, parts)
