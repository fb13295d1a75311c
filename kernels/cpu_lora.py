"""LoRA deltas of a step's small adapter segments on CPU: the C++ op (cpu_lora.cpp), float32 or bfloat16."""

import torch
import torch.nn.functional as F

from kvloom.kernels.cpu_extensions import build_extension

PAIR_BLOCK = 16  # columns of B a block of the bfloat16 pairs layout holds


def lora_extension():
    return build_extension("kvloom_cpu_lora")


def runs_on_cpu_op(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether LoRA deltas run on the C++ op here: on CPU, in float32 or bfloat16, where the op builds."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and lora_extension() is not None


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


MAX_PARTS = 3  # a fused linear's parts (q|k|v): cpu_lora.cpp's MAX_PARTS


def weights_table(pairs: list[tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int, int, int], ...]] | None]
                  ) -> torch.Tensor:
    """An adapter's weights as the op finds them, one int64 row per linear (None: not patched): where its A
    [R, in] and B (as `pack_expand` gives it) are, its rank, in features, element size and B's element count (the
    op checks them against x and y), and its parts (r0, r1, c0, c1). The rows hold addresses: whoever holds the
    table holds the tensors too (engine/lora/adapter.py)."""
    width = lora_extension().lora_table_width()
    table = torch.zeros(len(pairs), width, dtype=torch.int64)
    for row, pair in zip(table, pairs):
        if pair is None:
            continue
        a, b, parts = pair
        if not (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and len(parts) <= MAX_PARTS):
            raise ValueError(f"weights_table: A and B must be contiguous, of one dtype, with at most {MAX_PARTS} parts")
        flat = [bound for part in parts for bound in part]
        row[: 7 + len(flat)] = torch.tensor([a.data_ptr(), b.data_ptr(), a.shape[0], a.shape[1], a.element_size(),
                                             b.numel(), len(parts), *flat])
    return table


def lora_add_(y: torch.Tensor, x: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, linear: int,
              first_row: int = 0) -> None:
    """y += (x @ A.T) @ B over each segment's rows, with its adapter's weights for `linear`: `tables` [S, linears,
    width] stacks the segments' adapters' `weights_table`s, `rows` [S, 2] their first and end rows in the step,
    and x's rows are the step's from `first_row` on."""
    lora_extension().lora_add_(y, x, tables, rows, linear, first_row)
