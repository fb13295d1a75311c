"""LLMEngine: add_request / step / abort over scheduler + runner, in one process, no Ray.

The step reads schedule -> execute -> update -> outputs. Around it: `InputProcessor` builds and checks requests,
`OutputProcessor` checks stops and builds outputs, `engine/resources.py` picks the device, dtypes and KV budget,
`ParkedKV` holds disaggregation's hand-offs. All state hangs off the instance (no module globals), so several
engines can share a process.
"""

import itertools
import time
from functools import partial

from kvloom.engine.config import EngineConfig
from kvloom.engine.counter_draws import seed_words
from kvloom.engine.cuda_graphs import captures_graphs
from kvloom.engine.engine_stats import EngineStats
from kvloom.engine.errors import ConfigError, InvalidRequestError
from kvloom.engine.host_memory import trim_heap
from kvloom.engine.input_processor import InputProcessor
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.kv_tiers.tiers import KVTiers, kv_identity
from kvloom.engine.lora.adapter_slots import AdapterSlots
from kvloom.engine.lora.identity import LoRARequest
from kvloom.engine.lora.registry import LoRARegistry
from kvloom.engine.model.decoder import FusedDecoder
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.model.model_loader import LoadedModel, eos_token_ids, load_decoder, load_tokenizer
from kvloom.engine.output_processor import OutputProcessor
from kvloom.engine.outputs import RequestOutput
from kvloom.engine.parking import ParkedKV
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.resources import (check_batch_limits, kv_block_count, profile_cuda_budget, resolve_device,
                                     resolve_dtype, resolve_kv_dtype, resolve_max_model_len)
from kvloom.engine.runner import ModelRunner
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.scheduler import Scheduler, SchedulerLimits
from kvloom.engine.speculation.speculative import SpecDecodeStats, build_speculator, load_draft
from kvloom.engine.startup_times import StartupTimes
from kvloom.engine.structured_output import GrammarCompiler
from kvloom.engine.tensor_parallel.tp_runner import start_tensor_parallel
from kvloom.engine.tool_calls.formats import tool_format
from kvloom.engine.tool_calls.tools import ToolUse
from kvloom.engine.tensor_parallel.tp_shards import plan_shards
from kvloom.kernels.backends import select_backend
from kvloom.kernels.cpu_lora import runs_on_cpu_op

TIER_LOAD_WAIT_S = 0.01  # a step with only tier loads in flight waits this long at most for one (then commands run)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, tensor_parallel_launch: dict | None = None,
                 **overrides) -> None:
        """`tensor_parallel_launch`: how to start the other ranks (`start_tensor_parallel`'s keywords; default:
        local processes)."""
        if overrides:  # on top of `config` if given; validated, so an unknown key still fails
            config = EngineConfig(**{**(config.model_dump() if config else {}), **overrides})
        config = config or EngineConfig()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.startup = StartupTimes()
        with self.startup.phase("model files and tokenizer"):
            model_dir = resolve_model_dir(config.model)  # a GGUF file is converted here, once per machine
            self.model_config = ModelConfig.from_dir(model_dir)
            self.tokenizer = load_tokenizer(model_dir, self.model_config)
        self.shards = plan_shards(self.model_config, config.tensor_parallel_size)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.adapters = (LoRARegistry(config.lora, self.model_config, self.dtype,
                                      for_cpu_op=runs_on_cpu_op(self.device, self.dtype)) if config.lora else None)
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
                                     self.grammars, tool_format(config.tool_call_parser,
                                                                getattr(self.tokenizer, "chat_template", None)),
                                     self.adapters)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.block_size = config.block_size
        if config.tensor_parallel_size == 1:  # loaded first: a CUDA budget is profiled on it
            with self.startup.phase("weights"):
                self.decoder = load_decoder(model_dir, self.model_config, self.dtype, self.device, config.model_impl,
                                            config.quantization)
            if config.lora and not isinstance(self.decoder, FusedDecoder):
                raise ConfigError("lora", "adapters patch kvloom's fused decoder, which does not cover this model "
                                          "(model_impl: kvloom says why)")
        # CUDA: the adapters' slot buffers, allocated before the KV budget is profiled (it leaves room for them)
        self.adapter_slots = (AdapterSlots(self.model_config, config.lora.max_loras, config.lora.max_lora_rank,
                                           self.dtype, self.device) if config.lora and self.device.type == "cuda"
                              else None)
        # under tensor parallelism every rank holds the same blocks, each with its own KV heads: the widest
        # rank's share sets how many fit its budget
        bytes_per_token = max(s.local_config(self.model_config).kv_bytes_per_token(self.kv_dtype) for s in self.shards)
        spec = config.speculative_config
        self.draft = load_draft(spec, self) if spec and spec.method == "draft_model" else None
        if self.draft is not None:  # its cache holds as many blocks as the target's: one budget pays for both
            bytes_per_token += self.draft.config.kv_bytes_per_token(self.kv_dtype)
        draft_runner = partial(self._runner, model=self.draft) if self.draft is not None else None
        self.num_blocks = kv_block_count(config, self.device, bytes_per_token, self.max_model_len,
                                         lambda: profile_cuda_budget(config, self.device, self.max_model_len,
                                                                     self._runner, draft_runner))
        check_batch_limits(config, self.max_model_len)
        with self.startup.phase("kernels and KV cache" if config.tensor_parallel_size == 1 else "ranks"):
            if config.tensor_parallel_size > 1:
                self.runner = start_tensor_parallel(config, self.model_config, self.dtype, self.kv_dtype,
                                                    self.device, self.num_blocks, **(tensor_parallel_launch or {}))
                self.decoder = self.runner.decoder
            else:
                self.runner = self._runner(self.num_blocks)
                self.runner.adapters, self.runner.adapter_slots = self.adapters, self.adapter_slots
        if config.tensor_parallel_size == 1 and captures_graphs(self.device, config.enforce_eager, self.runner.backend):
            with self.startup.phase("CUDA graphs"):
                self.runner.capture_graphs(config.max_num_seqs, -(-self.max_model_len // self.block_size))
        self.kv = KVCacheManager(self.num_blocks, self.block_size, config.enable_prefix_caching,
                                 self._kv_tiers(model_dir) if config.tiers is not None else None)
        self.handoffs = ParkedKV(self.kv)
        trim_heap()  # what loading freed
        self.scheduler = Scheduler(SchedulerLimits(
            config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            config.scheduling_policy, config.batching, config.bucket_width, config.max_wait_ms / 1000,
            *((config.lora.max_loras, config.lora.slot_tenure_s) if config.lora else ()),
            yielding_prefill_tokens=config.yielding_prefill_tokens), self.kv)
        self.step_seconds = 0.0  # see EngineStats.step_seconds
        self.speculator = build_speculator(spec, self) if spec else None
        self.requests: dict[str, Request] = {}
        self._seed_counter = itertools.count(config.seed * 1_000_003)

    def _kv_tiers(self, model_dir) -> KVTiers | None:
        """The configured KV tiers over this engine's cache (engine/kv_tiers/)."""
        key_cache = self.runner.kv_caches[0][0]
        shape = (len(self.runner.kv_caches), 2, self.block_size, *key_cache.shape[2:])
        identity = kv_identity(model_dir, self.kv_dtype, shape, self.config.quantization)
        return KVTiers.build(self.config.tiers, identity, self.runner.export_blocks,
                             self.runner.import_blocks, shape, self.kv_dtype, self.device)

    def _runner(self, num_blocks: int, model: LoadedModel | None = None) -> ModelRunner:
        """The target's runner, or `model`'s (a draft's, whose first pass the CUDA budget profiles)."""
        backend = select_backend(self.config.attention_backend, self.device)
        decoder, model_config = (model.decoder, model.config) if model else (self.decoder, self.model_config)
        return ModelRunner(decoder, model_config, backend, num_blocks, self.block_size, self.kv_dtype, self.device)

    # ---- requests ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tools: ToolUse | None = None) -> list[int]:
        return self.inputs.apply_chat_template(messages, tools)

    def encode(self, prompt: str) -> list[int]:
        return self.inputs.encode(prompt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None,
                     lora: str | LoRARequest | None = None, cache_namespace: int | None = None) -> Request:
        """Validate and tokenize (`InputProcessor`); touches no engine state but the adapters' (thread-safe), so
        any thread may call it. `lora`: a LoRA adapter, by name (or name and directory); `cache_namespace`: whose
        prefix cache it shares (engine/cache_namespace.py)."""
        return self.inputs.make_request(request_id, prompt, params, priority, arrival_time, lora, cache_namespace)

    def load_adapter(self, lora: str | LoRARequest) -> None:
        """Read and check a LoRA adapter now, as a request naming it would; raises InvalidRequestError."""
        self.inputs.adapter(lora)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora: str | LoRARequest | None = None, cache_namespace: int | None = None) -> Request:
        request = self.make_request(request_id, prompt, params, priority, arrival_time, lora, cache_namespace)
        self.add_prepared(request)
        return request

    def add_prepared(self, request: Request) -> None:
        self.register_request(request)
        self.scheduler.add_request(request)

    def add_continued(self, request: Request, output_token_ids: list[int], emitted_chars: int) -> None:
        """Go on with an output another engine began (its replica died mid-stream). The tokens become this
        request's output as if generated here, so max_tokens, penalties, a grammar and stop strings go on
        from them; it is recomputed like a preempted request (a prefix-cache hit where the blocks are here).
        The text held back for a stop string or a split character comes out once, from `emitted_chars` (what
        the client has) on."""
        self.inputs.check_continuation(request, output_token_ids)
        self.register_request(request)
        self.outputs.replay(request, output_token_ids, emitted_chars)
        self.scheduler.add_request(request)

    def register_request(self, request: Request) -> None:
        """Per-request engine state: its draws' seed, detokenizer, and the id table."""
        if request.request_id in self.requests or self.handoffs.holds(request.request_id):
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        seed = request.sampling_params.seed
        request.draw_seed = seed_words(seed if seed is not None else next(self._seed_counter))
        self.outputs.track(request)
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any stage and free everything it holds."""
        self.handoffs.release(request_id)
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return self._finished(request, [])

    def shutdown(self) -> None:
        """Stop what runs outside this step (tensor-parallel workers, the KV tiers' writes); the engine serves nothing
        after."""
        self.runner.shutdown()
        if self.kv.tier_io is not None:
            self.kv.tier_io.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def warm_up(self) -> None:
        """Run one short request to its end, so that what starts lazily (the kernels' thread pool, the
        allocator's first blocks, first-call dispatch) is not paid by the first real request. Its prompt, one
        id repeated, is unlike any text, so it gives no later prompt a prefix-cache hit."""
        length = max(1, min(32, self.max_model_len - 2, self.config.max_num_batched_tokens))
        prompt = [min(1000, self.vocab_size - 1)] * length
        with self.startup.phase("warm-up"):
            self.add_request("kvloom-warm-up", prompt, SamplingParams(max_tokens=min(2, self.max_model_len - length),
                                                                      temperature=0, detokenize=False))
            while self.has_unfinished():
                self.step()

    def release_parked(self, request_id: str) -> bool:
        """Free a hand-off's blocks: a parked prefill (sent, or given up) or a reserved decode."""
        return self.handoffs.release(request_id)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if out.empty:
            self.kv.wait_for_tiers(TIER_LOAD_WAIT_S)  # with nothing else to run, until a load ends
            return []
        self.runner.copy_blocks(out.block_copies)
        if self.speculator is not None:
            self.speculator.draft(out.scheduled)
        now = time.monotonic()
        for request, _ in out.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        sampled = self.runner.execute(out.scheduled)
        if self.speculator is not None:
            self.speculator.record(out.scheduled, sampled)
        advanced = self.scheduler.update_from_output(
            out, {k: [t.token_id for t in tokens] for k, tokens in sampled.items()})
        now = time.monotonic()
        outputs = []
        for request in advanced:
            if request.first_token_time is None:
                request.first_token_time = now
            new_tokens, status = self.outputs.accept(request, sampled[request.request_id])
            if status is None:
                outputs.append(self.outputs.output(request, new_tokens))
                continue
            self.scheduler.finish_request(request, status, free_blocks=not request.park_kv)
            if request.park_kv:
                self.handoffs.park(request)
            outputs.append(self._finished(request, new_tokens))
        self.step_seconds += time.monotonic() - start
        return outputs

    def _finished(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        return self.outputs.output(request, new_tokens)

    # ---- counters ---------------------------------------------------------------------------
    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Drafted and accepted tokens so far; None without speculative decoding."""
        return self.speculator.stats if self.speculator is not None else None

    def stats(self) -> EngineStats:
        return EngineStats.collect(self.scheduler, self.kv, self.step_seconds)
