"""LLMEngine: add_request / step / abort over scheduler + runner, in one process, no Ray.

All state hangs off the instance (no module globals), so several engines can share a process.
"""

import itertools
import logging
import operator
import time
from dataclasses import dataclass

import torch

from kvloom.engine.config import EngineConfig
from kvloom.engine.detokenizer import IncrementalDetokenizer, token_decoder
from kvloom.engine.errors import ConfigError, InvalidRequestError
from kvloom.engine.host_memory import trim_heap
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.model_config import ModelConfig
from kvloom.engine.model_files import resolve_model_dir
from kvloom.engine.model_loader import load_decoder, load_tokenizer
from kvloom.engine.logits_processors import LogitsAdjuster
from kvloom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.runner import ModelRunner
from kvloom.engine.sampler import SampledToken
from kvloom.engine.sampling import SamplingParams
from kvloom.engine.scheduler import Scheduler, SchedulerLimits
from kvloom.engine.speculative import SpecDecodeStats, build_speculator
from kvloom.engine.structured_output import GrammarCompiler
from kvloom.engine.tp_runner import start_tensor_parallel
from kvloom.engine.tp_shards import plan_shards
from kvloom.engine.unicode_text import not_unicode_field
from kvloom.kernels.backends import select_backend
from kvloom.kernels.host_isa import HostISA, auto_cpu_dtype, host_isa

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    peak_used_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    batch_slots: int  # requests computed, summed over steps
    step_seconds: float  # wall time in steps that ran a batch: over a span's wall time, how busy the engine was
    idle_slot_steps: int
    padding_tokens: int

    @property
    def mean_batch_size(self) -> float:
        return self.batch_slots / self.num_steps if self.num_steps else 0.0


def check_unicode(field: str, value) -> None:
    """Text the tokenizer can encode (see engine/unicode_text.py), else an error naming `field`."""
    if (where := not_unicode_field(value)) is not None:
        raise InvalidRequestError(field, "is not valid Unicode text (a lone UTF-16 surrogate"
                                         f"{f' at {where}' if where else ''})")


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
        logger.info("kvloom engine runs on %s%s", requested,
                    "" if requested == "cuda" else " (no CUDA device visible)")
    elif requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda requested but no CUDA device is visible")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device, isa: HostISA | None = None) -> torch.dtype:
    """The engine's dtype; `auto` asks the hardware (and says what it found, once per engine)."""
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        chosen, reason = ("bfloat16", "CUDA device") if bf16 else ("float16", "CUDA device without bfloat16")
    else:
        isa = isa or host_isa()
        chosen = auto_cpu_dtype(isa)
        reason = isa.describe() + (": bfloat16 in hardware" if isa.fast_bfloat16 else
                                   ": bfloat16 weights widened in registers" if chosen == "bfloat16" else
                                   ": no bfloat16 units")
    logger.info("kvloom engine dtype %s (auto; %s)", chosen, reason)
    return DTYPES[chosen]


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
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
        model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = load_tokenizer(model_dir, self.model_config)
        self.decode_tokens = token_decoder(self.tokenizer)
        self.shards = plan_shards(self.model_config, config.tensor_parallel_size)
        context_length = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or context_length
        if self.max_model_len > context_length:
            raise ConfigError("max_model_len", f"{self.max_model_len} exceeds the model's context length "
                                               f"({context_length})")
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.block_size = config.block_size
        if config.tensor_parallel_size == 1:  # loaded first: a CUDA budget is profiled on it
            self.decoder = load_decoder(model_dir, self.model_config, self.dtype, self.device, config.model_impl)
        # under tensor parallelism every rank holds the same blocks, each with its own KV heads: the widest
        # rank's share sets how many fit its budget
        self.num_blocks = self._num_blocks(max(s.local_config(self.model_config).kv_bytes_per_token(self.kv_dtype)
                                               for s in self.shards))
        self._validate_limits()
        if config.tensor_parallel_size > 1:
            self.runner = start_tensor_parallel(config, self.model_config, self.dtype, self.kv_dtype, self.device,
                                                self.num_blocks, **(tensor_parallel_launch or {}))
            self.decoder = self.runner.decoder
        else:
            backend = select_backend(config.attention_backend, self.device)
            self.runner = ModelRunner(self.decoder, self.model_config, backend, self.num_blocks, self.block_size,
                                      self.kv_dtype, self.device)
        self.kv = KVCacheManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
        trim_heap()  # what loading freed (measured on SmolLM2: ~45 MB)
        limits = SchedulerLimits(
            config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            config.scheduling_policy, config.batching, config.bucket_width, config.max_wait_ms / 1000,
        )
        self.scheduler = Scheduler(limits, self.kv)
        self.step_seconds = 0.0  # see EngineStats.step_seconds
        spec = config.speculative_config
        self.speculator = build_speculator(spec, self) if spec else None
        self.requests: dict[str, Request] = {}
        self.parked: dict[str, Request] = {}  # finished prefills holding KV until handed off
        self.reserved: dict[str, Request] = {}  # decodes holding blocks while their KV arrives
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._seed_counter = itertools.count(config.seed * 1_000_003)

    # ---- set-up -----------------------------------------------------------------------------
    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if isinstance(self.tokenizer.eos_token_id, int):
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _num_blocks(self, bytes_per_token: int) -> int:
        block_bytes = bytes_per_token * self.block_size
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda" and self.config.tensor_parallel_size > 1:
                raise ConfigError("kv_cache_memory_bytes", "set each rank's KV budget for tensor parallelism on "
                                                           "CUDA (the memory profile runs one device's forward)")
            budget = self._profile_cuda_budget() if self.device.type == "cuda" else DEFAULT_CPU_KV_BYTES
        num_blocks = budget // block_bytes
        needed = -(-self.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ConfigError(
                "kv_cache_memory_bytes",
                f"budget of {budget} bytes holds {num_blocks} blocks of {self.block_size} tokens "
                f"({block_bytes} bytes each), but one max-length request ({self.max_model_len} tokens) "
                f"needs {needed}: raise the budget or lower max_model_len",
            )
        return int(num_blocks)

    def _profile_cuda_budget(self) -> int:
        """KV budget on CUDA: the utilization target minus the peak of a max-size forward."""
        tokens = self.config.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        torch.cuda.reset_peak_memory_stats(self.device)
        runner = ModelRunner(self.decoder, self.model_config, select_backend(self.config.attention_backend, self.device),
                             blocks, self.block_size, self.kv_dtype, self.device)
        probe = Request("profile", [0] * tokens, SamplingParams(max_tokens=1, temperature=0))
        probe.block_ids = list(range(blocks))
        runner.execute([(probe, tokens)], {"profile": torch.Generator(self.device)})
        peak = torch.cuda.max_memory_allocated(self.device)
        del runner
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak
        if budget <= 0:
            raise ConfigError("gpu_memory_utilization", f"leaves no room for KV after a {peak}-byte peak")
        return budget

    def _validate_limits(self) -> None:
        cfg = self.config
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ConfigError("max_num_batched_tokens", f"must be >= max_num_seqs ({cfg.max_num_seqs})")
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "max_num_batched_tokens",
                f"without chunked prefill it must be >= max_model_len ({self.max_model_len}), "
                "or a long prompt could never be scheduled",
            )

    # ---- requests ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template")
        check_unicode("messages", messages)
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def encode(self, prompt: str) -> list[int]:
        check_unicode("prompt", prompt)
        return self.tokenizer.encode(prompt)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and tokenize; touches no engine state, so any thread may call it."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:  # a float id would pass the range check below and then fail every later step
            token_ids = [operator.index(t) for t in token_ids]
        except TypeError:
            raise InvalidRequestError("prompt", "token ids must be integers") from None
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"is {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)",
            )
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise InvalidRequestError("min_tokens", f"is {params.min_tokens}, but max_model_len is "
                                          f"{self.max_model_len} and the prompt takes {len(token_ids)} tokens of it")
            params = params.model_copy(update={"max_tokens": room})
        if params.max_tokens > room:  # as vLLM and OpenAI answer, rather than stopping short silently
            raise InvalidRequestError(
                "max_tokens",
                f"is {params.max_tokens}, but max_model_len is {self.max_model_len} and the prompt takes "
                f"{len(token_ids)} tokens of it: at most {room} can be generated",
            )
        self._check_vocabulary("prompt", token_ids)
        self._check_vocabulary("logit_bias", params.logit_bias)
        self._check_vocabulary("stop_token_ids", params.stop_token_ids)
        return Request(
            request_id, token_ids, params, priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time, prompt=text,
            logits_adjuster=LogitsAdjuster.for_request(params, self.eos_token_ids),
            grammar=self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None,
        )

    def _check_vocabulary(self, field: str, token_ids) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(field, f"token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})")

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        request = self.make_request(request_id, prompt, params, priority, arrival_time)
        self.add_prepared(request)
        return request

    def add_prepared(self, request: Request) -> None:
        self.register_request(request)
        self.scheduler.add_request(request)

    def add_continued(self, request: Request, output_token_ids: list[int], emitted_chars: int) -> None:
        """Go on with an output another engine began (its replica died mid-stream). The tokens become this
        request's output as if generated here, so max_tokens, penalties, a grammar and stop strings go on
        from them; it is recomputed like a preempted request (a prefix-cache hit where the blocks are here).
        The detokenizer replays them, so text held back for a stop string or a split character comes out
        once, from `emitted_chars` (what the client has) on."""
        params = request.sampling_params
        self._check_vocabulary("output_token_ids", output_token_ids)
        if not 0 < len(output_token_ids) < params.max_tokens:
            raise InvalidRequestError("output_token_ids", f"continues with {len(output_token_ids)} tokens; "
                                      f"max_tokens is {params.max_tokens}")
        self.register_request(request)
        detok = self._detokenizers.get(request.request_id)
        for token in output_token_ids:
            request.token_ids.append(token)
            if request.grammar is not None:
                request.grammar.accept(token)
            if detok is not None:
                detok.add_token(token, check_stop=False)  # it did not stop there, or it would not go on
        if detok is not None:
            detok.emitted = min(emitted_chars, len(detok.text))
        self.scheduler.add_request(request)

    def register_request(self, request: Request) -> None:
        """Per-request engine state: generator, detokenizer, and the id table."""
        if request.request_id in self.requests or request.request_id in self.parked:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        params = request.sampling_params
        seed = params.seed if params.seed is not None else next(self._seed_counter)
        self._generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)
        if params.detokenize:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.decode_tokens, request.token_ids, params.stop  # an imported decode: prompt + first token
            )
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any stage and free everything it holds."""
        self.release_parked(request_id)
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return self._finalize(request, [])

    def shutdown(self) -> None:
        """Stop what runs outside this process (tensor-parallel workers); the engine serves nothing after."""
        self.runner.shutdown()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def warm_up(self) -> None:
        """Run one short request to its end, so that what starts lazily (the kernels' thread pool, the
        allocator's first blocks, first-call dispatch) is not paid by the first real request. Its prompt, one
        id repeated, is unlike any text, so it gives no later prompt a prefix-cache hit."""
        length = max(1, min(32, self.max_model_len - 2, self.config.max_num_batched_tokens))
        prompt = [min(1000, self.vocab_size - 1)] * length
        self.add_request("kvloom-warm-up", prompt, SamplingParams(max_tokens=min(2, self.max_model_len - length),
                                                                  temperature=0, detokenize=False))
        while self.has_unfinished():
            self.step()

    def release_parked(self, request_id: str) -> bool:
        """Free a hand-off's blocks: a parked prefill (sent, or given up) or a reserved decode."""
        request = self.parked.pop(request_id, None) or self.reserved.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        return request is not None

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if out.empty:
            return []
        self.runner.copy_blocks(out.block_copies)
        if self.speculator is not None:
            self.speculator.draft(out.scheduled, self._generators)
        now = time.monotonic()
        for request, _ in out.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        sampled = self.runner.execute(out.scheduled, self._generators)
        if self.speculator is not None:
            self.speculator.record(out.scheduled, sampled)
        advanced = self.scheduler.update_from_output(
            out, {k: [t.token_id for t in tokens] for k, tokens in sampled.items()})
        now = time.monotonic()
        outputs = []
        for request in advanced:
            if request.first_token_time is None:
                request.first_token_time = now
            new_tokens, status = self._accept_tokens(request, sampled[request.request_id])
            if status is not None:
                self.scheduler.finish_request(request, status, free_blocks=not request.park_kv)
                if request.park_kv:
                    self.parked[request.request_id] = request
            outputs.append(self._finalize(request, new_tokens) if status else self._output(request, new_tokens))
        self.step_seconds += time.monotonic() - start
        return outputs

    def _accept_tokens(self, request: Request, tokens: list[SampledToken]) -> tuple[list[int], RequestStatus | None]:
        """Check stop conditions token by token (a step may bring several); drop the tokens after a stop."""
        first = request.num_tokens - len(tokens)
        new_tokens: list[int] = []
        status = None
        for token in tokens:
            new_tokens.append(token.token_id)
            if token.logprobs is not None:
                request.output_logprobs.append(token.logprobs)
            status = self._check_stop(request, token.token_id, first + len(new_tokens) - request.num_prompt_tokens)
            if status is not None:
                del request.token_ids[first + len(new_tokens):]
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                break
        return new_tokens, status

    def _check_stop(self, request: Request, token_id: int, num_output: int) -> RequestStatus | None:
        """Whether the output ends at `token_id`, its `num_output`-th token."""
        params = request.sampling_params
        if request.grammar is not None and request.grammar.accept(token_id):
            return RequestStatus.FINISHED_STOPPED  # the grammar ends on an end token, which is not text
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        detok = self._detokenizers.get(request.request_id)
        if detok is not None:
            stop = detok.add_token(token_id, check_stop=num_output >= params.min_tokens)
            if stop is not None:
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or request.num_prompt_tokens + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        finished = request.is_finished
        delta = detok.release(finished) if detok else ""
        wants_logprobs = request.sampling_params.logprobs is not None
        completion = CompletionOutput(
            text=detok.text[: detok.emitted] if detok else "",
            token_ids=request.output_token_ids,
            delta_text=delta,
            delta_token_ids=new_tokens,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
        )
        metrics = RequestMetrics(
            request.arrival_time, request.first_scheduled_time, request.first_token_time,
            time.monotonic() if finished else None,
        )
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, [completion], finished,
            request.num_cached_prompt_tokens, metrics, request.priority,
        )

    def _finalize(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        output = self._output(request, new_tokens)
        self.requests.pop(request.request_id, None)
        self._detokenizers.pop(request.request_id, None)
        self._generators.pop(request.request_id, None)
        return output

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Drafted and accepted tokens so far; None without speculative decoding."""
        return self.speculator.stats if self.speculator is not None else None

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        counters = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=pool.num_free,
            num_blocks=pool.num_blocks,
            peak_used_blocks=pool.peak_num_used,
            kv_cache_usage=pool.usage,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=counters.num_steps,
            batch_slots=counters.batch_slots,
            step_seconds=self.step_seconds,
            idle_slot_steps=counters.idle_slot_steps,
            padding_tokens=self.scheduler.batching.padding_tokens,
        )
