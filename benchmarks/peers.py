"""Peers on the same model and workload: transformers `generate` on padded static batches, and
transformers' own continuous batching (`ContinuousBatchingManager`, paged cache).

Both decode greedily with EOS disabled (not masked), like kvloom's `ignore_eos`, so every system
computes the same tokens and their outputs can be compared one for one.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvloom.benchmarks.metrics import BatchCounters, RequestRecord
from kvloom.benchmarks.workloads import Workload, WorkloadRequest

NO_EOS = -1  # transformers' continuous batching reads -1 as "no EOS token"


def load_hf_model(model: str, attn_implementation: str = "sdpa"):
    """The stock transformers model (no kvloom attention), fp32, as the peers run it."""
    from transformers import AutoModelForCausalLM

    from kvloom.engine.model.model_files import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(model), dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True
    ).eval()


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class _StepClock:
    """A `generate` streamer that only timestamps each decoding step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@dataclass
class HFStaticPeer:
    """A static server: batches of `batch_size` in arrival order, left-padded, each run to its longest member.

    A batch starts when the previous one has finished and all its members have arrived. Finished
    members keep computing (idle slot-steps) and short prompts compute padding: both are counted.
    """

    model: torch.nn.Module
    batch_size: int

    @torch.inference_mode()
    def run(self, workload: Workload, on_record: Callable[[RequestRecord], None] | None = None,
            ) -> tuple[list[RequestRecord], BatchCounters, float]:
        from transformers import GenerationConfig

        pad = self.model.config.pad_token_id or 0
        counters = BatchCounters()
        records: list[RequestRecord] = []
        requests = sorted(workload.requests, key=lambda r: r.arrival_s)
        t0 = time.perf_counter()
        for i in range(0, len(requests), self.batch_size):
            batch = requests[i : i + self.batch_size]
            _sleep_until(t0 + max(r.arrival_s for r in batch))
            longest_prompt = max(len(r.prompt) for r in batch)
            steps = max(r.max_tokens for r in batch)
            ids = torch.tensor([[pad] * (longest_prompt - len(r.prompt)) + r.prompt for r in batch])
            mask = (torch.arange(longest_prompt) >= longest_prompt - torch.tensor([len(r.prompt) for r in batch])[:, None])
            # eos_token_id=[]: no EOS at all (None would fall back to the model's EOS and stop rows early;
            # min_new_tokens would mask EOS logits and change greedy outputs).
            config = GenerationConfig(do_sample=False, max_new_tokens=steps, eos_token_id=[], pad_token_id=pad)
            clock = _StepClock()
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=mask.long(), generation_config=config, streamer=clock)
            for row, r in enumerate(batch):
                times = clock.times[: r.max_tokens]
                records.append(RequestRecord(
                    r.request_id, len(r.prompt), out[row, longest_prompt : longest_prompt + r.max_tokens].tolist(),
                    arrival=t0 + r.arrival_s, first_token=times[0], finished=times[-1], first_scheduled=start,
                    token_times=times,
                ))
                if on_record:
                    on_record(records[-1])
            counters.num_steps += steps
            counters.busy_slot_steps += sum(r.max_tokens for r in batch)
            counters.idle_slot_steps += sum(steps - r.max_tokens for r in batch)
            counters.padding_tokens += sum(longest_prompt - len(r.prompt) for r in batch)
            counters.num_prompt_tokens += sum(len(r.prompt) for r in batch)
        return records, counters, time.perf_counter() - t0


@dataclass
class HFContinuousPeer:
    """transformers' continuous batching with the same KV budget, token budget and sequence cap as kvloom.

    Requests are submitted at their arrival times while the manager's own thread generates.
    """

    model: torch.nn.Module
    kv_cache_bytes: int
    max_batch_tokens: int
    max_requests_per_batch: int
    page_size: int = 256

    def _configs(self, workload: Workload):
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        cfg = self.model.config
        bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
        generation = GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=cfg.pad_token_id or 0,
                                      max_new_tokens=max(r.max_tokens for r in workload.requests))
        batching = ContinuousBatchingConfig(
            page_size=self.page_size,
            num_blocks=max(1, self.kv_cache_bytes // (bytes_per_token * self.page_size)),
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_requests_per_batch,
            auto_switch_to_flash=False,  # no flash attention on CPU; keep the implementation we loaded
        )
        return generation, batching

    def run(self, workload: Workload, on_record: Callable[[RequestRecord], None] | None = None,
            ) -> tuple[list[RequestRecord], BatchCounters, float]:
        # No inference_mode here: the manager's thread updates the cache it allocates here in place.
        generation, batching = self._configs(workload)
        by_id = {r.request_id: r for r in workload.requests}
        pending: list[WorkloadRequest] = sorted(workload.requests, key=lambda r: r.arrival_s, reverse=True)
        records: list[RequestRecord] = []
        with self.model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=batching, block=True, timeout=30,
        ) as manager:
            t0 = time.perf_counter()
            while len(records) < len(by_id):
                while pending and t0 + pending[-1].arrival_s <= time.perf_counter():
                    r = pending.pop()
                    manager.add_request(r.prompt, request_id=r.request_id, max_new_tokens=r.max_tokens,
                                        eos_token_id=NO_EOS, record_timestamps=True)
                wait = (t0 + pending[-1].arrival_s - time.perf_counter()) if pending else 1.0
                result = manager.get_result(timeout=max(wait, 1e-3))
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers continuous batching failed {result.request_id}: {result.error}")
                    r = by_id[result.request_id]
                    times = list(result.timestamps or [])
                    records.append(RequestRecord(
                        r.request_id, len(r.prompt), list(result.generated_tokens), arrival=t0 + r.arrival_s,
                        first_token=times[0], finished=times[-1], first_scheduled=result.lifespan[0],
                        token_times=times,
                    ))
                    if on_record:
                        on_record(records[-1])
                elif not manager.is_running() and not pending:
                    raise RuntimeError("transformers continuous batching stopped before finishing the workload")
            wall = time.perf_counter() - t0
        return records, BatchCounters(), wall
