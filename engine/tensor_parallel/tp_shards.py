"""How a model splits across the ranks of a tensor-parallel replica (Megatron-style), and loading one rank's share.

Attention splits by whole grouped-query groups: a rank holds some KV heads and exactly the query heads that
read them, so attention needs no communication. Where the group count does not divide by the rank count the
split is uneven (SmolLM2's 3 groups on 2 ranks: 2 and 1), which vLLM refuses; where there are fewer groups
than ranks, each group is replicated on `ranks / groups` ranks (the count must divide) and its query heads
split among them, unevenly where needed. QKV and gate|up are column-parallel (rows of the weight), o_proj and
down row-parallel (its columns) with one all-reduce each; the MLP's intermediate width, the embedding table
and the LM head split into contiguous, near-equal ranges (vocabulary-parallel).
Each rank reads only its slices from the checkpoint (safetensors slicing), never the whole tensor.
"""

import dataclasses
from dataclasses import dataclass

import torch

from kvloom.engine.model.checkpoint import Checkpoint
from kvloom.engine.errors import ConfigError
from kvloom.engine.model.model_config import ModelConfig


@dataclass(frozen=True)
class RankShard:
    rank: int
    world_size: int
    heads: tuple[int, int]  # query heads [start, end)
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]  # MLP columns
    vocab: tuple[int, int]  # embedding rows and LM head rows

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its heads, its MLP width, its vocabulary range."""
        return dataclasses.replace(
            config, num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate[1] - self.intermediate[0], vocab_size=self.vocab[1] - self.vocab[0])

    def describe(self) -> str:
        return (f"rank {self.rank}: query heads {self.heads[0]}-{self.heads[1] - 1}, KV heads "
                f"{self.kv_heads[0]}-{self.kv_heads[1] - 1}, MLP {self.intermediate[0]}:{self.intermediate[1]}, "
                f"vocab {self.vocab[0]}:{self.vocab[1]}")


def even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """`total` split into `parts` contiguous ranges, the first `total % parts` one longer."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        ranges.append((start, end))
        start = end
    return ranges


def plan_shards(config: ModelConfig, world_size: int) -> list[RankShard]:
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    per_group = heads // groups
    if world_size < 1:
        raise ConfigError("tensor_parallel_size", f"must be at least 1, got {world_size}")
    if world_size > heads:
        raise ConfigError("tensor_parallel_size", f"{world_size} ranks for {heads} attention heads: "
                                                  "every rank needs at least one head")
    if world_size <= groups:
        kv_ranges = even_ranges(groups, world_size)
        head_ranges = [(start * per_group, end * per_group) for start, end in kv_ranges]
    else:
        if world_size % groups:
            raise ConfigError("tensor_parallel_size", f"{world_size} ranks over {groups} KV heads: with more ranks "
                                                      "than KV heads, each KV head is replicated on the same "
                                                      "number of ranks, so the rank count must be a multiple of "
                                                      f"{groups}")
        copies = world_size // groups
        kv_ranges = [(rank // copies, rank // copies + 1) for rank in range(world_size)]
        head_ranges = [(group * per_group + start, group * per_group + end)
                       for group in range(groups) for start, end in even_ranges(per_group, copies)]
    mlp = even_ranges(config.intermediate_size, world_size)
    vocab = even_ranges(config.vocab_size, world_size)
    return [RankShard(rank, world_size, head_ranges[rank], kv_ranges[rank], mlp[rank], vocab[rank])
            for rank in range(world_size)]


class ShardedCheckpoint:
    """A checkpoint that hands out one rank's slice of each tensor (whole norms and biases of the output side)."""

    def __init__(self, checkpoint: Checkpoint, shard: RankShard, config: ModelConfig) -> None:
        self.checkpoint = checkpoint
        self.shard = shard
        self.dtype, self.device = checkpoint.dtype, checkpoint.device
        d = config.head_dim
        h, kv, mlp, vocab = shard.heads, shard.kv_heads, shard.intermediate, shard.vocab
        # (dimension, start, end) of each sliced tensor, by the last two parts of its name
        self._slices = {
            "q_proj.weight": (0, h[0] * d, h[1] * d), "q_proj.bias": (0, h[0] * d, h[1] * d),
            "k_proj.weight": (0, kv[0] * d, kv[1] * d), "k_proj.bias": (0, kv[0] * d, kv[1] * d),
            "v_proj.weight": (0, kv[0] * d, kv[1] * d), "v_proj.bias": (0, kv[0] * d, kv[1] * d),
            "o_proj.weight": (1, h[0] * d, h[1] * d),
            "gate_proj.weight": (0, *mlp), "up_proj.weight": (0, *mlp), "down_proj.weight": (1, *mlp),
            "embed_tokens.weight": (0, *vocab), "lm_head.weight": (0, *vocab),
        }

    def __contains__(self, name: str) -> bool:
        return name in self.checkpoint

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        cut = self._slices.get(".".join(name.split(".")[-2:]))
        if cut is None:
            return self.checkpoint.get(name, dtype)
        return self.checkpoint.get_slice(name, *cut, dtype)
