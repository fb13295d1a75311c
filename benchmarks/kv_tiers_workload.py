"""The KV tiers benchmark's prompts and setups, shared by its scenarios (benchmarks/kv_tiers.py and
kv_tiers_serve.py): synthetic prose as token ids (SmolLM2's tokenizer, or the tiny model's word ids), the
multi-turn conversations, and each setup's `kv_tiers`."""

import random
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvloom.benchmarks.workloads import load_tokenizer, synthetic_text

QUESTION_TOKENS, ANSWER_TOKENS = 48, 32
SETUPS = ("tiers off", "host tier", "host + disk")


@dataclass(frozen=True)
class Chat:
    """A multi-turn workload's token ids: the shared system prompt and each conversation's questions, turn by turn."""

    system: list[int]
    questions: list[list[list[int]]]

    @property
    def turns(self) -> int:
        return len(self.questions[0])


class Prose:
    """Token ids of synthetic prose (benchmarks/workloads.py): a system prompt from its start, passages from
    random places (seeded)."""

    def __init__(self, encode: Callable[[str], list[int]], seed: int) -> None:
        self.words = synthetic_text(200_000, seed=3).split()
        self.encode = encode
        self.rng = random.Random(seed)

    def head(self, tokens: int) -> list[int]:
        return self.encode(" ".join(self.words[:tokens]))[:tokens]

    def passage(self, tokens: int) -> list[int]:
        span = tokens * 5 // 3  # words enough for `tokens` tokens on SmolLM2's tokenizer
        start = self.rng.randrange(len(self.words) - span)
        return self.encode(" ".join(self.words[start:start + span]))[:tokens]


def encoder(model: str) -> Callable[[str], list[int]]:
    """SmolLM2's tokenizer, or for the tiny model a word's hash among its word ids (its tokenizer knows w3..w511)."""
    if model == "smollm2":
        tokenizer = load_tokenizer(model)
        return lambda text: tokenizer.encode(text, add_special_tokens=False)
    return lambda text: [3 + zlib.crc32(word.encode()) % 509 for word in text.split()]


def chat_tokens(prose: Prose, system_tokens: int, conversations: int, turns: int) -> Chat:
    system = prose.head(system_tokens)
    return Chat(system, [[prose.passage(QUESTION_TOKENS) for _ in range(turns)] for _ in range(conversations)])


def tier_setups(host: str, disk: str, tier_bytes: int) -> dict[str, dict | None]:
    """Each setup's `kv_tiers`: none, a host tier of `tier_bytes`, or an eighth of that spilling to a disk tier of
    `tier_bytes` (callers give twice their working set)."""
    return {"tiers off": None,
            "host tier": {"host_bytes": tier_bytes, "host_path": host},
            "host + disk": {"host_bytes": tier_bytes // 8, "host_path": host,
                            "disk": {"path": disk, "bytes": tier_bytes}}}


def emptied(*folders: str) -> None:
    """The tiers' folders, empty: every setup starts cold."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        Path(folder).mkdir()
