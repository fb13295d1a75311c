"""The runner's block tables, kept from step to step (as vLLM's v1 `BlockTable`): one host table in which a running
request holds a row, its blocks in order and 0 after them.

A request's blocks change when it starts, gets a block (in decode, once every `block_size` tokens), gives some back
(rejected drafts, preemption) or ends; rebuilding every request's padded table as Python lists each step cost host
time in proportion to every context's length. Here a step compares each request's blocks with its row's (a list
comparison in C) and writes only what changed, then gathers its rows, as wide as its longest table, in its own
order: what the step's inputs carry to the device (step_plan.py packs them into its one copy, from pinned memory on
CUDA, so the table itself stays in ordinary memory). A step with the last one's requests in the same order (most
decode steps) takes the last one's rows without looking them up. A row is freed when a step runs without its request
and reused by the next one to come.
"""

import numpy as np


class BlockTable:
    def __init__(self) -> None:
        self.table = np.zeros((0, 0), dtype=np.int32)
        self.held: list[list[int]] = []  # per row, the blocks written there (0 after them)
        self.rows: dict[str, int] = {}  # request id -> its row
        self.free: list[int] = []
        # the last step's requests and their rows, and whether those are 0, 1, 2...: a slice of the table
        self.last_ids: list[str] = []
        self.last_rows: list[int] = []
        self.in_order = True

    def step(self, request_ids: list[str], tables: list[list[int]]) -> np.ndarray:
        """The step's tables: request_ids[i] holds the blocks tables[i]; [len(tables), width] int32, padded with 0,
        as wide as the longest (at least one block)."""
        width = max(map(len, tables), default=0) or 1
        if request_ids != self.last_ids:  # else the last step's rows
            self.last_ids, self.last_rows = list(request_ids), self._assign(request_ids)
            self.in_order = self.last_rows == list(range(len(self.last_rows)))
        rows = self.last_rows
        if width > self.table.shape[1] or len(self.held) > self.table.shape[0]:
            self._grow(width)
        for row, blocks in zip(rows, tables):
            if blocks != self.held[row]:
                self._write(row, blocks)
        return self.table[: len(rows), :width] if self.in_order else self.table[rows, :width]

    def _assign(self, request_ids: list[str]) -> list[int]:
        """The requests' rows: those they hold, and for the others free ones (the rows of requests not in the step
        freed first) or new ones."""
        live = set(request_ids)
        for gone in [request_id for request_id in self.rows if request_id not in live]:
            self.free.append(self.rows.pop(gone))
        for request_id in request_ids:
            if request_id not in self.rows:
                if not self.free:
                    self.free.append(len(self.held))
                    self.held.append([])
                self.rows[request_id] = self.free.pop()
        return [self.rows[request_id] for request_id in request_ids]

    def _grow(self, width: int) -> None:
        """Room for every row and `width` blocks, doubling what is short (rows and blocks are kept)."""
        rows, columns = self.table.shape
        grown = np.zeros((max(len(self.held), 2 * rows), max(width, 2 * columns)), dtype=np.int32)
        grown[:rows, :columns] = self.table
        self.table = grown

    def _write(self, row: int, blocks: list[int]) -> None:
        """Row `row` now holds `blocks`: what they share at the front with what it held stays."""
        held = self.held[row]
        if blocks[: len(held)] == held:  # blocks appended
            kept = len(held)
        elif held[: len(blocks)] == blocks:  # blocks given back
            kept = len(blocks)
        else:
            kept = 0
        self.table[row, kept : len(blocks)] = blocks[kept:]
        self.table[row, len(blocks) : len(held)] = 0
        self.held[row] = list(blocks)
