"""The stock transformers model as a kvloom decoder, with kvloom's paged attention plugged in.

For architectures the fused decoder does not cover (and `model_impl="transformers"`): the same call
shape as `FusedDecoder`, so the runner does not care which one it drives.
"""

from pathlib import Path

import torch

from kvloom.engine.model.attention import ATTENTION_NAME, ForwardContext, register_attention


class StockDecoder:
    def __init__(self, model) -> None:
        self.model = model
        self._decoder = model.base_model
        self._lm_head = model.get_output_embeddings()

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> "StockDecoder":
        from transformers import AutoModelForCausalLM

        register_attention()
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
        )
        return cls(model.to(device).eval())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                 keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of every row, or of `keep_rows` (the stock forward computes them all)."""
        hidden = self._decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                               kvloom_context=context).last_hidden_state[0]
        return hidden if keep_rows is None else hidden[keep_rows]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden)
