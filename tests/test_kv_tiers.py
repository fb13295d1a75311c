"""KV tiers (engine/kv_tiers/): full blocks written through to a host tier (spilling to disk) and read back where a
prefix misses the pool. Greedy float32 outputs are the same with tiers off, host, and host + disk, across eviction,
restore, a spill and a restarted engine; another engine of the node finds what one computed; other tenants and
adapters never get each other's blocks; a bad file is recomputed; a full tier never fails a request."""

import contextlib
import random

import pytest
import torch

from kvloom.engine.block_pool import prompt_block_hashes
from kvloom.engine.errors import ConfigError
from kvloom.engine.kv_tiers.block_store import SUFFIX
from kvloom.engine.kv_tiers.pool_copy import PoolCopy
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.sampling import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def prompts(count: int, shared: int = 96, own: int = 40, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a `shared`-token prefix, each with a tail of its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 500) for _ in range(own)] for _ in range(count)]


def engine(model_dir, tmp_path, host: int = 0, disk: int = 0, blocks: int = 24) -> LLMEngine:
    """A small pool (`blocks` blocks: the working set does not fit), the tiers under `tmp_path`."""
    tiers = {"host_bytes": host, "host_path": str(tmp_path / "host"),
             **({"disk": {"path": str(tmp_path / "disk"), "bytes": disk}} if disk else {})}
    return LLMEngine(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=2,
                     max_num_batched_tokens=256, kv_cache_memory_bytes=blocks * block_bytes(model_dir),
                     **({"kv_tiers": tiers} if host or disk else {}))


def block_bytes(model_dir) -> int:
    from kvloom.engine.model.model_config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    return BLOCK * config.kv_bytes_per_token(__import__("torch").float32)


def run(engine: LLMEngine, batch: list[list[int]], namespace: int | None = None) -> list[list[int]]:
    outputs = {}
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}-{id(batch)}", prompt, GREEDY, cache_namespace=namespace)
        while engine.has_unfinished():  # one at a time: each evicts what the one before left in the pool
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    if engine.kv.tier_io is not None:
        engine.kv.tier_io.drain()  # its blocks written, for the engines that read them next
    return [outputs[f"r{i}-{id(batch)}"] for i in range(len(batch))]


def tier(engine: LLMEngine, name: str) -> dict:
    return engine.stats().kv_tiers[name]


def test_outputs_are_the_same_with_tiers_off_host_and_host_and_disk_across_eviction_and_restore(tiny_model_dir,
                                                                                                   tmp_path):
    work = prompts(6, seed=1)
    again = work[::-1]  # by then the pool has evicted the shared prefix's early users' tails
    expected = run(engine(tiny_model_dir, tmp_path / "off"), work + again)
    host = engine(tiny_model_dir, tmp_path / "h", host=64 << 20)
    assert run(host, work + again) == expected
    assert tier(host, "host")["hits"] > 0 and host.stats().prefix_cache_hits > 0
    spilled = engine(tiny_model_dir, tmp_path / "hd", host=6 * block_bytes(tiny_model_dir), disk=64 << 20)
    assert run(spilled, work + again) == expected
    assert tier(spilled, "disk")["hits"] > 0  # the host tier, 6 blocks, spilled the rest
    assert tier(spilled, "host")["used_bytes"] <= 6 * block_bytes(tiny_model_dir) + 4096 * 6


def test_an_engine_started_later_on_the_node_finds_what_another_computed(tiny_model_dir, tmp_path):
    work = prompts(3, seed=2)
    first = engine(tiny_model_dir, tmp_path, host=64 << 20, disk=64 << 20)
    expected = run(first, work)
    joined = engine(tiny_model_dir, tmp_path, host=64 << 20, disk=64 << 20)  # a replica that joins or restarts
    assert run(joined, work) == expected
    stats = joined.stats()
    assert tier(joined, "host")["hits"] >= 96 // BLOCK and stats.prefix_cache_hits >= 96


def test_another_tenants_or_adapters_prefix_is_never_served_from_a_tier(tiny_model_dir, tmp_path):
    work = prompts(2, seed=3)
    owner = engine(tiny_model_dir, tmp_path, host=64 << 20)
    run(owner, work, namespace=11)
    other = engine(tiny_model_dir, tmp_path, host=64 << 20)
    run(other, work[:1], namespace=12)
    assert tier(other, "host")["hits"] == 0 and other.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "other-model"])
def test_a_damaged_or_foreign_block_file_is_recomputed_never_used(tiny_model_dir, build_tiny_model, tmp_path,
                                                                  damage):
    work = prompts(2, seed=4)
    expected = run(engine(tiny_model_dir, tmp_path / "off"), work)
    other = damage == "other-model"  # the same layout and tokens from another checkpoint: another identity
    writer = engine(build_tiny_model(tmp_path / "other", seed=7) if other else tiny_model_dir, tmp_path, host=64 << 20)
    run(writer, work[:1])
    files = sorted(writer.kv.tiers.stores["host"].path.glob(f"*{SUFFIX}"))
    assert files
    reader = engine(tiny_model_dir, tmp_path, host=64 << 20)
    for file in files:
        data = bytearray(file.read_bytes())
        if damage == "corrupt":
            data[-5] ^= 0xFF
        elif damage == "truncate":
            del data[len(data) // 2:]
        file.unlink()
        (reader.kv.tiers.stores["host"].path / file.name).write_bytes(bytes(data))  # where the reader looks
    assert run(reader, work) == expected
    assert tier(reader, "host")["hits"] == 0 and tier(reader, "host")["misses"] >= 1  # looked, found nothing usable


def test_a_full_disk_drops_blocks_and_never_fails_a_request(tiny_model_dir, tmp_path):
    """Writes that fail (here: past a file-size limit, as on a full disk) are dropped; requests go on."""
    import resource
    import signal

    work = prompts(4, seed=5)
    expected = run(engine(tiny_model_dir, tmp_path / "off"), work)
    full = engine(tiny_model_dir, tmp_path / "full", host=64 << 20)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, previous_limit[1]))  # a block file is larger
    try:
        outputs = run(full, work)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert outputs == expected and tier(full, "host")["blocks_written"] == 0
    assert not list((tmp_path / "full" / "host").rglob("*.tmp"))  # no half-written file left


def test_a_tier_folder_that_cannot_be_made_is_a_config_error(tiny_model_dir, tmp_path):
    (tmp_path / "host").write_text("a file where the tier's folder would be")
    with pytest.raises(ConfigError, match="kv_tiers.host_path"):
        engine(tiny_model_dir, tmp_path, host=64 << 20)


def test_tiers_need_the_prefix_cache_and_one_rank(tiny_model_dir):
    with pytest.raises((ConfigError, ValueError), match="enable_prefix_caching"):
        LLMEngine(model=str(tiny_model_dir), enable_prefix_caching=False, kv_offloading_size=0.1)
    with pytest.raises((ConfigError, ValueError), match="tensor_parallel_size"):
        LLMEngine(model=str(tiny_model_dir), tensor_parallel_size=2, kv_offloading_size=0.1)


class HeldWorker:
    """Holds the tier worker (a job that waits on an event) so a load begun after it is still reading."""

    def __init__(self, engine: LLMEngine) -> None:
        import threading

        self.gate = threading.Event()
        engine.kv.tier_io.worker.submit(self.gate.wait)

    def release(self) -> None:
        self.gate.set()


def warm_engine(model_dir, tmp_path, work: list[list[int]]) -> LLMEngine:
    """An engine started after another computed `work` on the node: their prefixes are in the host tier only."""
    run(engine(model_dir, tmp_path, host=64 << 20), work)
    return engine(model_dir, tmp_path, host=64 << 20)


def test_a_request_waiting_for_its_blocks_does_not_stall_the_batch(tiny_model_dir, tmp_path):
    work = prompts(1, seed=6)
    expected = run(engine(tiny_model_dir, tmp_path / "off"), work)
    joined = warm_engine(tiny_model_dir, tmp_path, work)
    joined.add_request("running", prompts(1, shared=20, seed=9)[0], SamplingParams(max_tokens=40, temperature=0))
    joined.step()
    held = HeldWorker(joined)
    joined.add_request("loading", work[0], GREEDY)
    decoded = [out for _ in range(5) for out in joined.step()]
    assert [out.request_id for out in decoded] == ["running"] * 5  # the batch went on while the load waited
    assert joined.stats().kv_tiers["loads_in_flight"] == 1
    held.release()
    finished = {}
    while joined.has_unfinished():
        finished |= {out.request_id: out.outputs[0].token_ids for out in joined.step() if out.finished}
    assert finished["loading"] == expected[0]
    assert tier(joined, "host")["hits"] >= 96 // BLOCK


def test_a_request_cancelled_while_its_blocks_load_frees_everything(tiny_model_dir, tmp_path):
    work = prompts(1, seed=7)
    joined = warm_engine(tiny_model_dir, tmp_path, work)
    held = HeldWorker(joined)
    joined.add_request("cancelled", work[0], GREEDY)
    assert joined.step() == [] and joined.stats().kv_tiers["pinned_blocks"] >= 96 // BLOCK
    joined.abort("cancelled")
    held.release()
    while joined.has_unfinished():  # until the worker is done with the blocks and the engine takes them back
        joined.step()
    stats = joined.stats()
    assert stats.kv_tiers["pinned_blocks"] == 0 and stats.kv_tiers["loads_in_flight"] == 0
    assert stats.num_free_blocks == stats.num_blocks and joined.kv.num_requests_holding == 0
    assert all(block.ref_cnt == 0 for block in joined.kv.pool.blocks)
    # a cancelled load registers nothing
    assert not set(prompt_block_hashes(work[0], BLOCK)) & set(joined.kv.pool.cached)


def test_on_cuda_a_load_copies_from_pinned_memory_on_its_own_stream_finished_before_the_load_is_done(
        tiny_model_dir, tmp_path, monkeypatch):
    """The CUDA copy path on CPU, torch.cuda's streams faked (on a real device: tests/gpu): the worker's buffer is
    asked for pinned and kept, every block reaches the pool inside a stream made once, and that stream is
    synchronized before the load is reported done (the step's stream reads the blocks next)."""
    events, buffers, streams = [], [], []

    class Stream:
        def __init__(self, device):
            streams.append(device)

        def synchronize(self):
            events.append("synchronize")

    @contextlib.contextmanager
    def stream(_):
        events.append("enter")
        yield
        events.append("exit")

    def host_buffer(copy, count, size):
        buffers.append(copy.on_side_stream)  # pinned memory's request, on a host that has none
        return torch.empty(count, size, dtype=torch.uint8)

    def fake_cuda(copy, device):
        init(copy, device)
        copy.on_side_stream = True

    work = prompts(3, seed=8)
    expected = run(engine(tiny_model_dir, tmp_path / "off"), work)
    run(engine(tiny_model_dir, tmp_path, host=64 << 20), work)
    init = PoolCopy.__init__
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(PoolCopy, "host_buffer", host_buffer)
    monkeypatch.setattr(PoolCopy, "__init__", fake_cuda)
    joined = engine(tiny_model_dir, tmp_path, host=64 << 20)  # started after: the prefixes are in the tier only
    tiers, tier_io = joined.kv.tiers, joined.kv.tier_io
    place, load = tiers.import_blocks, tier_io.load
    tiers.import_blocks = lambda *args: (events.append("import"), place(*args))
    tier_io.load = lambda *args: watched(load(*args))

    def watched(tier_load):
        tier_load.done.add_done_callback(lambda _: events.append("done"))
        return tier_load

    assert run(joined, work) == expected
    assert tier(joined, "host")["hits"] >= 96 // BLOCK
    loads = events.count("done")
    assert loads >= 1 and events == ["enter", "import", "exit", "synchronize", "done"] * loads
    assert len(streams) == 1 and buffers and all(buffers) and len(buffers) <= loads
