"""A GGUF model's linears as the file stores them (`quantization: gguf`): the blocks file that conversion
writes beside the de-quantized weights (engine/model/gguf_convert.py), read where the decoder packs a linear.

A linear whose GGUF type kvloom's quantized GEMM does not run (K-quants, F16) is packed from the de-quantized
weights as without quantization; the loader says which, once.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kvloom.engine.model.gguf_convert import QUANTIZED_FILE
from kvloom.kernels.gguf_blocks import QuantType

logger = logging.getLogger(__name__)


class BlockSource(Protocol):
    """Where the decoder finds a linear's GGUF blocks: a GGUF model's (below) or an integer checkpoint's
    (engine/model/integer_weights.py: compressed-tensors, AWQ, GPTQ)."""

    def blocks(self, names: list[str]) -> tuple[torch.Tensor, QuantType] | None: ...

    def int8_activations(self, names: list[str]) -> bool:
        """Whether the linear computing the weights `names` side by side takes int8 activations
        (kernels/quantized_linear.py)."""

    def log_inflated(self) -> None:
        """One line naming what runs de-quantized, if anything (once the decoder is built)."""


@dataclass
class QuantizedWeights:
    path: Path
    types: dict[str, str]  # every 2-D weight's GGUF type, by transformers name
    int8: bool = False  # `quantization: gguf-int8`: every linear's (kernels/quantized_linear.py)

    @classmethod
    def open(cls, model_dir: Path, int8: bool = False) -> "QuantizedWeights | None":
        """The model directory's quantized weights; None where it has none (not converted from a GGUF file)."""
        path = model_dir / QUANTIZED_FILE
        if not path.is_file():
            return None
        with safe_open(path, framework="pt") as f:
            return cls(path, json.loads(f.metadata()["gguf_types"]), int8)

    def int8_activations(self, names: list[str]) -> bool:
        return self.int8

    def blocks(self, names: list[str]) -> tuple[torch.Tensor, QuantType] | None:
        """The weights `names` (side by side, as one linear computes them) as rows of GGUF blocks, if all are
        stored in one type kvloom runs; else None."""
        kinds = {self.types.get(name) for name in names}
        if len(kinds) != 1 or (kind := kinds.pop()) not in QuantType.__members__:
            return None
        with safe_open(self.path, framework="pt") as f:
            rows = [f.get_tensor(name) for name in names]
        return (torch.cat(rows) if len(rows) > 1 else rows[0]), QuantType[kind]

    def log_inflated(self) -> None:
        """One line naming the GGUF types of the linears that run de-quantized, if any."""
        inflated = sorted({kind for name, kind in self.types.items()
                           if kind not in QuantType.__members__ and not name.endswith("embed_tokens.weight")})
        if inflated:
            logger.info("quantization gguf: weights stored as %s run de-quantized (kvloom's quantized GEMM runs %s)",
                        ", ".join(inflated), ", ".join(QuantType.__members__))
