"""Iteration-level scheduler: one rule for prefill and decode.

Every running request has `num_computed_tokens` that catches up with its token count, within a
per-step token budget. Decodes are scheduled first, then unfinished prefills (chunked when
`enable_chunked_prefill`), then waiting requests while slots and blocks last. When the pool runs
dry a victim (lowest priority, then latest arrival) is preempted by recompute: its blocks are
freed and it re-enters the waiting queue with its generated tokens kept. A choice of an n > 1 request
is admitted by forking its running sibling's prompt KV (`_fork_source`, `KVCacheManager.fork`). A request whose
prefix a KV tier holds past the pool's hit is admitted with blocks for all of it and waits, LOADING, out of the
batch while the tier's blocks are read into them (engine/kv_tiers/tier_io.py); it runs from the step after.
"""

from dataclasses import dataclass, field

from kvloom.engine.batching import make_batching
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.lora.adapter_admission import AdapterAdmission
from kvloom.engine.prefill_yield import PrefillYield
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.request_queue import RequestQueue, make_queue, priority_key


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (from, to): forks' partial blocks, before the step

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    policy: str = "fcfs"
    batching: str = "continuous"
    bucket_width: int = 64
    max_wait_s: float = 0.05
    max_loras: int | None = None  # distinct LoRA adapters among the running requests (None: no adapters served)
    slot_tenure_s: float = 10.0  # see engine/lora/adapter_admission.py
    yielding_prefill_tokens: int = 16  # see engine/prefill_yield.py


@dataclass
class SchedulerCounters:
    num_steps: int = 0  # steps that ran something
    batch_slots: int = 0  # sum over steps of requests in the step (mean batch = this / steps)
    idle_slot_steps: int = 0  # batch-level strategies: slots of finished members still waiting


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager) -> None:
        self.limits = limits
        self.kv = kv
        self.waiting: RequestQueue = make_queue(limits.policy)
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, holding blocks, waiting for their prefix from a KV tier
        self.num_preemptions = 0
        self.batching = make_batching(limits.batching, limits.max_num_seqs, limits.bucket_width, limits.max_wait_s)
        self.counters = SchedulerCounters()
        self.adapters = AdapterAdmission(limits.max_loras, limits.slot_tenure_s)
        # a prompt computed whole (no chunked prefill) cannot yield in chunks
        self.prefill_yield = PrefillYield(limits.yielding_prefill_tokens if limits.enable_chunked_prefill else None)

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def finish_request(self, request: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Take a request out of the scheduler for good; its blocks are freed unless parked."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.LOADING:
            self.loading.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        if free_blocks:
            self.kv.free(request)
        self.batching.on_finish(request)
        request.status = status

    @property
    def has_unfinished(self) -> bool:
        """Requests to run, or tier loads to take in (a cancelled one's blocks are freed when it ends)."""
        return bool(self.running) or bool(self.loading) or len(self.waiting) > 0 or self.kv.loading_tiers

    # ---- scheduling -------------------------------------------------------------------------
    def _victim_key(self, request: Request) -> tuple[int, float]:
        if self.limits.policy == "priority":
            return priority_key(request)
        return (0, request.arrival_time)

    def adopt_running(self, request: Request) -> None:
        """Take in a request whose KV is already in its blocks (a disaggregated decode)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.add_front(request)
        self.num_preemptions += 1
        out.preempted.append(request)

    def _make_room_for_priority(self, out: SchedulerOutput) -> None:
        """Priority policy: a waiting request outranking a running one may evict it."""
        while len(self.waiting) and self.running:
            head = self.waiting.peek()
            if self.prefill_yield.yields(head):  # evicting for it would thrash: its prompt may wait a step anyway
                head = next((r for r in self.waiting if not self.prefill_yield.yields(r)), None)
                if head is None:
                    return
            victim = max(self.running, key=self._victim_key)
            if self._victim_key(victim) <= priority_key(head):
                return
            first_chunk = min(head.num_tokens, self.limits.max_num_batched_tokens)
            fits = (
                len(self.running) < self.limits.max_num_seqs
                and self.kv.blocks_needed(first_chunk) <= self.kv.pool.num_free
            )
            if fits:
                return
            self._preempt(victim, out)

    def _chunk(self, num_new: int, budget: int) -> int:
        """How many of `num_new` tokens fit this step (0: wait for a later step)."""
        if num_new > budget and not self.limits.enable_chunked_prefill:
            return 0
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._take_loaded()
        if self.limits.policy == "priority":
            self._make_room_for_priority(out)  # evicts to admit: admission below still runs
        evicted_for_priority = len(out.preempted)
        budget = self.limits.max_num_batched_tokens
        planned: dict[str, int] = {}

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        yielding = [r for r in prefilling if self.prefill_yield.yields(r)]  # last, after admissions
        ordinary = [r for r in prefilling if not self.prefill_yield.yields(r)]
        self.prefill_yield.start()
        for index, request in enumerate(decoding + ordinary):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            # drafts are optional: they get what the budget has left after one token for every later
            # decode, and are dropped before anyone is evicted for their slots
            spare = budget - max(len(decoding) - index - 1, 0)
            del request.spec_token_ids[max(spare - 1, 0):]
            num_new = self._chunk(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            budget = self._run(request, num_new, budget, planned, out)
            if index >= len(decoding) and request.request_id in planned:
                self.prefill_yield.spend(request, num_new)  # a prompt that does not yield: none for those that do

        running_before = len(self.running)
        if len(out.preempted) == evicted_for_priority:  # no pool pressure among running requests
            budget = self._admit_waiting(budget, planned, out)
        admitted = len(self.running) > running_before
        for request in yielding:
            if request.status != RequestStatus.RUNNING:
                continue
            num_new = self.prefill_yield.room(self._chunk(request.num_tokens - request.num_computed_tokens, budget))
            # a step that admitted preempts no one: short of blocks, the prompt waits a step
            budget = self._run(request, num_new, budget, planned, out, preempt=not admitted)
            if request.request_id in planned:
                self.prefill_yield.spend(request, num_new)

        out.scheduled = [(r, planned[r.request_id]) for r in self.running if r.request_id in planned]
        if out.scheduled:
            self.counters.num_steps += 1
            self.counters.batch_slots += len(out.scheduled)
            self.counters.idle_slot_steps += self.batching.idle_slots()
        return out

    def _run(self, request: Request, num_new: int, budget: int, planned: dict[str, int], out: SchedulerOutput,
             preempt: bool = True) -> int:
        """Plan `num_new` tokens of a running request, preempting others (or itself) while the pool is short, or
        (`preempt` False) planning nothing then; returns the budget left."""
        if num_new == 0:
            return budget
        while not self.kv.allocate_slots(request, num_new):
            if not preempt:
                return budget
            if request.spec_token_ids:
                num_new -= len(request.spec_token_ids)
                request.spec_token_ids = []
                continue
            victim = max(self.running, key=self._victim_key)
            budget += planned.pop(victim.request_id, 0)
            self._preempt(victim, out)
            if victim is request:
                return budget
        planned[request.request_id] = num_new
        return budget - num_new

    def _admit_waiting(self, budget: int, planned: dict[str, int], out: SchedulerOutput) -> int:
        """Admit in queue order among what the batching strategy allows; stop at the first misfit.

        A request evicted this very step is not taken back in it (that would only thrash). A request whose LoRA
        adapter has no slot waits without holding back those behind it (engine/lora/adapter_admission.py).
        """
        adapters = self.adapters.start(self.running)
        for request in self.batching.admissible(self.waiting):
            seats_taken = len(self.running) + len(self.loading)
            if budget <= 0 or seats_taken >= self.limits.max_num_seqs or request in out.preempted:
                break
            adapter = request.lora.name if request.lora is not None else None
            if not adapters.admits(adapter):
                continue
            source = self._fork_source(request)
            if source is not None:
                num_cached, num_new = request.num_tokens - 1, 1
                copies = self.kv.fork(source, request, num_cached)
                if copies is None:
                    break
                out.block_copies += copies
            else:
                cached = self.kv.find_cached_prefix(request)
                run = self.kv.tier_run(request, cached)
                if run is None:
                    continue  # its prefix is being read for another request; those behind it need not wait
                num_cached = len(cached) * self.kv.block_size
                num_new = self._chunk(request.num_tokens - num_cached - len(run) * self.kv.block_size, budget)
                if self.prefill_yield.yields(request):
                    num_new = self.prefill_yield.room(num_new)
                    if num_new == 0:
                        continue  # it waits for a step with room for yielding prompts; those behind it need not
                if num_new == 0 or not self.kv.allocate_slots(request, num_new, cached, len(run)):
                    break
                if run:
                    self._load(request, num_cached, run)
                    continue
                self.prefill_yield.spend(request, num_new)
            self.waiting.remove(request)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            adapters.admitted(adapter)
            planned[request.request_id] = num_new
            budget -= num_new
        return budget

    def _load(self, request: Request, num_cached: int, run: list[tuple[int, tuple[int, ...]]]) -> None:
        """Set an admitted request aside while a tier's `run` of its prefix is read into its blocks."""
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.LOADING
        self.loading.append(request)
        self.kv.begin_tier_load(request, run)

    def _take_loaded(self) -> None:
        """Requests whose tier loads ended run from this step, from what was loaded."""
        for request, num_loaded in self.kv.end_tier_loads():
            self.loading.remove(request)
            request.num_computed_tokens += num_loaded
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _fork_source(self, request: Request) -> Request | None:
        """n > 1: the running sibling whose KV holds this request's whole prompt but its last token, if any. The
        router starts a prompt's choice j once choice j-1 has its first token, so the first one has computed it."""
        if request.fork_of is None or request.num_output_tokens:
            return None
        source = next((r for r in self.running if r.request_id == request.fork_of), None)
        if (source is None or source.num_computed_tokens < request.num_tokens - 1
                or source.prompt_token_ids != request.prompt_token_ids or source.lora != request.lora):
            return None
        return source

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance progress after a step; returns the requests that received new tokens.

        A request that verified drafts rolls back over the rejected ones: their KV slots are dead (later
        steps overwrite them), blocks holding only such slots go back to the pool, and the prefix cache
        only ever registers blocks of kept tokens.
        """
        advanced = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens_with_spec:
                new_tokens = sampled[request.request_id]
                if request.spec_token_ids:
                    request.num_computed_tokens -= len(request.spec_token_ids) + 1 - len(new_tokens)
                    request.spec_token_ids, request.spec_probs = [], None
                    self.kv.free_tail(request, request.num_tokens + len(new_tokens))
                request.token_ids.extend(new_tokens)
                advanced.append(request)
            self.kv.cache_full_blocks(request)
        return advanced
