"""Moving one request's KV between engines (disaggregated prefill -> decode).

The prefill engine parks a finished prompt's blocks; `export_kv` copies exactly those blocks out
of every layer's cache. The decode engine checks the header first (a mismatch is an error, never
garbage attention), `import_kv` allocates fresh blocks (False when its pool or batch is full: the
caller waits and retries, nothing is dropped), writes the KV in and runs the request on from the
first token.
"""

import hashlib
from dataclasses import asdict, dataclass

import torch

from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.request import Request

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class KVTransferError(RuntimeError):
    """A KV hand-off that cannot be used (mismatched engines, lost peer)."""


@dataclass(frozen=True)
class KVHeader:
    model_id: int  # 63-bit digest of the model name
    dtype: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int

    @staticmethod
    def for_engine(engine: LLMEngine, num_tokens: int) -> "KVHeader":
        key_cache = engine.runner.kv_caches[0][0]
        digest = hashlib.blake2b(engine.config.model.encode(), digest_size=8).digest()
        return KVHeader(
            model_id=int.from_bytes(digest, "little") >> 1, dtype=DTYPE_CODES[key_cache.dtype],
            block_size=engine.block_size, num_layers=len(engine.runner.kv_caches),
            num_kv_heads=engine.model_config.num_key_value_heads, head_dim=key_cache.shape[3], num_tokens=num_tokens,
        )

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(list(asdict(self).values()), dtype=torch.int64)

    @staticmethod
    def from_tensor(values: torch.Tensor) -> "KVHeader":
        return KVHeader(*values.tolist())

    def check_matches(self, local: "KVHeader") -> None:
        for name, theirs in asdict(self).items():
            if name != "num_tokens" and theirs != getattr(local, name):
                raise KVTransferError(f"KV header mismatch on {name}: sender has {theirs}, receiver {getattr(local, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return next(dtype for dtype, code in DTYPE_CODES.items() if code == self.dtype)

    def payload_shape(self) -> tuple[int, ...]:
        num_blocks = -(-self.num_tokens // self.block_size)
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def export_kv(engine: LLMEngine, request_id: str) -> tuple[KVHeader, torch.Tensor]:
    """The parked request's KV as one [layers, 2, blocks, block_size, kv_heads, head_dim] tensor."""
    request = engine.handoffs.parked(request_id)
    if request is None:
        raise KVTransferError(f"no parked KV for request {request_id}")
    header = KVHeader.for_engine(engine, request.num_computed_tokens)
    return header, engine.runner.export_blocks(request.block_ids[: header.payload_shape()[2]])


def export_parked(engine: LLMEngine, request_id: str) -> tuple[KVHeader, torch.Tensor] | None:
    """`export_kv`, or None when the request is no longer parked (its hand-off was given up)."""
    return export_kv(engine, request_id) if engine.handoffs.parked(request_id) is not None else None


def reserve_kv(engine: LLMEngine, request: Request) -> bool:
    """Allocate blocks for a prompt's KV before receiving it; False while the pool or batch is full."""
    if len(engine.scheduler.running) + engine.handoffs.num_reserved >= engine.config.max_num_seqs:
        return False
    if not engine.kv.allocate_slots(request, len(request.prompt_token_ids)):
        return False
    engine.handoffs.reserve(request)
    return True


def activate_kv(engine: LLMEngine, request: Request, first_token: int, payload: torch.Tensor) -> None:
    """Write the received KV into the reserved blocks and continue decoding from the first token."""
    engine.handoffs.activate(request.request_id)
    engine.runner.import_blocks(request.block_ids, payload)
    request.num_computed_tokens = len(request.prompt_token_ids)
    request.token_ids.append(first_token)
    if request.grammar is not None:  # the prefill replica's grammar chose it; this one's starts behind
        request.grammar.accept(first_token)
    engine.kv.cache_full_blocks(request)
    engine.register_request(request)
    engine.scheduler.adopt_running(request)


def import_kv(engine: LLMEngine, request: Request, first_token: int, payload: torch.Tensor) -> bool:
    """Reserve and activate in one go (the object-store path, where the KV is already here)."""
    if not reserve_kv(engine, request):
        return False
    activate_kv(engine, request, first_token, payload)
    return True
