"""The runner's persistent block tables (engine/block_table.py): over random steps of requests coming, growing,
giving blocks back, being preempted and readmitted with other blocks, sitting a step out, finishing and their ids
reused, every step's tables equal the padded lists they replace, rows are reused, and a row is written only where
its request's blocks changed."""

import random

import numpy as np
import pytest

from kvloom.engine.block_table import BlockTable
from kvloom.kernels.metadata import AttentionMetadata


@pytest.mark.parametrize("churn", [0.0, 1.0], ids=["steady", "churning"])
def test_every_steps_tables_equal_the_padded_lists_over_random_steps(churn):
    """Steady: requests come and grow, none leaves (the step's rows stay 0, 1, 2...); churning: all of it."""
    rng = random.Random(0)
    table, live, most = BlockTable(), {}, 0
    fresh = iter(range(10**6))
    for _ in range(3000):
        for request_id in list(live):
            blocks, roll = live[request_id], rng.random()
            if roll < 0.05 * churn:
                del live[request_id]  # finished
            elif roll < 0.1 * churn:
                live[request_id] = [next(fresh) for _ in range(rng.randrange(1, 9))]  # preempted, readmitted
            elif roll < 0.2:
                live[request_id] = blocks[: rng.randrange(len(blocks) + 1)]  # blocks of rejected drafts back
            elif roll < 0.5:
                live[request_id] = blocks + [next(fresh) for _ in range(rng.randrange(1, 4))]
            else:  # the same blocks in a new list, as the cache manager gives them each step
                live[request_id] = list(blocks)
        while len(live) < 12 and rng.random() < 0.5:
            live[f"r{rng.randrange(40)}"] = [next(fresh) for _ in range(rng.randrange(0, 6))]  # ids reused
        step = [request_id for request_id in live if rng.random() >= 0.03 * churn]  # the others sit this step out
        if rng.random() < 0.3 * churn:
            rng.shuffle(step)
        tables = [live[request_id] for request_id in step]
        padded = table.step(step, tables)
        assert padded.dtype == np.int32 and padded.tolist() == AttentionMetadata.padded(tables)
        most = max(most, len(step))
    assert len(table.held) == most  # a row per request of the largest step: rows are reused


def test_a_row_is_written_only_where_its_requests_blocks_changed(monkeypatch):
    table, writes = BlockTable(), []
    write = BlockTable._write
    monkeypatch.setattr(BlockTable, "_write", lambda self, row, blocks: writes.append(list(blocks)) or
                        write(self, row, blocks))
    table.step(["a", "b"], [[1, 2], [3]])
    assert writes == [[1, 2], [3]]
    table.step(["b", "a"], [[3], [1, 2]])  # new lists of the same blocks, in another order: nothing written
    table.step(["a", "b"], [[1, 2, 7], [3]])  # a's new block
    assert writes[2:] == [[1, 2, 7]]
    assert table.step(["a"], [[1]]).tolist() == [[1]] and table.table[table.rows["a"]].tolist()[:3] == [1, 0, 0]
