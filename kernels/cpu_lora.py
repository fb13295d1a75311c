"""LoRA deltas of a step's small adapter segments on CPU: the C++ op (cpu_lora.cpp), float32 or bfloat16."""

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension

PAIR_BLOCK = 16  # columns of B a block of the bfloat16 pairs layout holds


def lora_extension():
    return build_extension("kvloom_cpu_lora")


def packs_expand(dtype: torch.dtype) -> bool:
    """Whether the op reads B in `pack_expand`'s layout for this dtype (bfloat16 on CPUs with AVX512-BF16)."""
    return lora_extension().lora_packs_expand(dtype)


def pack_expand(b: torch.Tensor, parts: tuple[tuple[int, int, int, int], ...]) -> torch.Tensor:
    """B [R, out] as the op reads it: as it is, or (where `packs_expand`) each part's nonzero block in blocks of 16
    columns, each block's rows in pairs with a pair's two values side by side per column, zero-padded to whole
    pairs and blocks: the layout the AVX512-BF16 dot product takes (kernels/cpu_lora.cpp)."""
    if not packs_expand(b.dtype):
        return b
    blocks = []
    for r0, r1, c0, c1 in parts:
        block = F.pad(b[r0:r1, c0:c1], (0, -(c1 - c0) % PAIR_BLOCK, 0, (r1 - r0) % 2))
        rows, columns = block.shape
        blocks.append(block.reshape(rows // 2, 2, columns // PAIR_BLOCK, PAIR_BLOCK).permute(2, 0, 3, 1).reshape(-1))
    return torch.cat(blocks)


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], rows: list[int],
              parts: list[int]) -> None:
    """y[r] += (x[r] @ a[s]) @ b[s] for the rows r of each segment s (`rows`: first and end row per segment);
    `parts`: per segment, its part count, then each part's b rows and columns (r0, r1, c0, c1); each b as
    `pack_expand` gives it."""
    lora_extension().lora_add_(y, x, a, b, rows, parts)
