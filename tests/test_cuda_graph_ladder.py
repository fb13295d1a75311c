"""Which decode batch replays which CUDA graph, and how its inputs are padded (engine/cuda_graphs.py). The
graphs themselves need a GPU (tests/gpu); the ladder and the static buffers are plain tensors, checked here."""

import pytest
import torch

from kvloom.engine.cuda_graphs import StaticDecodeInputs, captures_graphs, graph_sizes, is_plain_decode, padded_size
from kvloom.engine.step_plan import StepInputs
from kvloom.kernels.metadata import AttentionMetadata


def test_the_ladder_is_1_2_4_then_every_8_up_to_max_num_seqs():
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(3) == [1, 2, 3] and graph_sizes(1) == [1]


@pytest.mark.parametrize("batch, size", [(1, 1), (3, 4), (5, 8), (8, 8), (9, 16), (63, 64), (64, 64), (65, None),
                                         (0, None)])
def test_a_batch_pads_to_the_smallest_graph_that_holds_it(batch, size):
    assert padded_size(batch, graph_sizes(64)) == size


def step(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int = 4) -> StepInputs:
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    tokens = sum(query_lens)
    return StepInputs(torch.arange(100, 100 + tokens), torch.tensor([p for q, s in zip(query_lens, seq_lens)
                                                                      for p in range(s - q, s)]), meta,
                      torch.arange(tokens))


def test_only_steps_of_one_new_token_per_request_with_every_row_sampled_replay():
    assert is_plain_decode(step([1, 1], [5, 9], [[3, 4], [7, 8, 2]]))
    assert not is_plain_decode(step([1, 6], [5, 9], [[3, 4], [7, 8, 2]]))  # a prefill chunk rides along
    drafted = step([1, 1], [5, 9], [[3, 4], [7, 8, 2]])
    drafted.sample_rows = drafted.sample_rows[:1]
    assert not is_plain_decode(drafted)


def test_the_real_rows_are_copied_and_the_padding_rows_read_one_slot_and_write_none():
    buffers = StaticDecodeInputs.allocate(8, 4, 16, torch.device("cpu"))
    assert (buffers.slot_mapping == -1).all() and (buffers.seq_lens == 1).all()  # the capture writes no KV
    decode = step([1, 1, 1], [5, 9, 2], [[3, 4], [7, 8, 2], [6]])
    buffers.block_tables.fill_(99)  # an earlier, wider step's tables
    buffers.fill(decode, 4)
    assert buffers.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buffers.positions[:4].tolist() == [4, 8, 1, 0]
    assert buffers.slot_mapping[:4].tolist() == decode.meta.slot_mapping.tolist() + [-1]
    assert buffers.seq_lens[:4].tolist() == [5, 9, 2, 1]
    assert buffers.block_tables[:4, :3].tolist() == [[3, 4, 0], [7, 8, 2], [6, 0, 0], [0, 0, 0]]
    assert (buffers.block_tables[3] == 0).all()  # the padding row's whole table
    meta = buffers.metadata(4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.num_seqs == 4 and meta.max_query_len == 1
    assert meta.max_seq_len == 4 * 16  # tokens, not blocks: the split-KV decode sizes its segments by it


def test_a_block_table_wider_than_the_graphs_is_refused():
    buffers = StaticDecodeInputs.allocate(2, 2, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="3 blocks exceeds the graphs' 2"):
        buffers.fill(step([1], [9], [[1, 2, 3]]), 1)


@pytest.mark.parametrize("backend, enforce_eager, device, captured", [
    ("triton", False, "cuda", True),
    ("reference", False, "cuda", False),  # it reads sequence lengths on the host: a sync inside capture
    ("triton", True, "cuda", False),
    ("triton", False, "cpu", False),
])
def test_graphs_are_captured_only_over_a_graph_safe_backend_on_cuda(backend, enforce_eager, device, captured, caplog):
    from kvloom.kernels.backends import AttentionBackend

    attention = AttentionBackend(backend, write_kv=None, paged_attention=None, graph_safe=backend == "triton")
    with caplog.at_level("INFO", logger="kvloom.engine.cuda_graphs"):
        assert captures_graphs(torch.device(device), enforce_eager, attention) is captured
    said = [r.message for r in caplog.records if "not graph-safe" in r.message]
    assert len(said) == (backend == "reference")


def test_select_backend_marks_only_triton_graph_safe():
    from kvloom.kernels.backends import select_backend

    assert not select_backend("reference", torch.device("cpu")).graph_safe
    assert not select_backend("cpu", torch.device("cpu")).graph_safe
    assert select_backend("triton", torch.device("cpu")).graph_safe
