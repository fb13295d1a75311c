"""Prompt lookup: the tokens that followed the latest earlier occurrence of the context's suffix.

Copy-heavy outputs (rewrites, extraction, code edits) repeat runs of their prompt or of themselves, so
the last few tokens often occurred before, and what came after them then is a good guess for what comes
next. The search is vectorised: one pass over the history per n-gram length, no per-token Python loop.
"""

import numpy as np

from kvloom.engine.speculation.model_proposers import Proposer
from kvloom.engine.request import Request


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: Request, k: int) -> list[int]:
        return self.lookup(request.token_ids, k)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens following the latest earlier match of the longest suffix (max_n down to min_n)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        # ends[j]: the suffix of length n also ends at position j < length - 1; grown one length at a time
        ends = np.ones(length - 1, dtype=bool)
        best_end = -1
        for n in range(1, min(self.max_n, length - 1) + 1):
            ends[: n - 1] = False  # an occurrence of length n cannot end before position n - 1
            ends[n - 1 :] &= tokens[: length - n] == tokens[length - n]
            hits = np.flatnonzero(ends)
            if hits.size == 0:
                break
            if n >= self.min_n:
                best_end = int(hits[-1])
        if best_end < 0:
            return []
        return tokens[best_end + 1 : best_end + 1 + k].tolist()
