"""How far the engine is from this machine's compute ceiling.

The ceiling is measured, not looked up: fp32 GEMMs (per shape the faster of MKL and prepacked
oneDNN) with the model's own weight shapes at M rows (M=64 for decode batches, M=256 for prefill
chunks). A workload's model FLOPs are counted from its
token counts: 2 x params per processed token for the decoder linears, 2 x hidden x vocab per
sampled row for the LM head, and 4 x heads x head_dim x context per token per layer for attention
(QK^T and PV). Roofline time = prefill FLOPs / rate(256) + decode FLOPs / rate(64).

The engine is held against the same ceiling with decode probes taken from a real run: its
decode-only steps at batch 64 (and about 32), timed as a whole and inside `runner.execute`; and,
for the decode-efficiency goal, with a paired probe that alternates batch-64 steps and the GEMM
rate in one process (`paired_decode_probe`).
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median_high

import torch

from kvloom.benchmarks.workloads import Workload
from kvloom.engine.model.model_config import ModelConfig
from kvloom.kernels.packed_linear import PackedLinear

DECODE_M, PREFILL_M = 64, 256


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelShape":
        return cls(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                   config.num_key_value_heads, config.head_dim, config.num_hidden_layers, config.vocab_size)

    def layer_linears(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's linears: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    @property
    def linear_params(self) -> int:
        """Decoder linear weights (every processed token multiplies all of them)."""
        return self.layers * sum(a * b for a, b in self.layer_linears())

    def token_flops(self) -> int:
        return 2 * self.linear_params

    def head_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    def key_flops(self) -> int:
        """Attention FLOPs per (token, key) pair over all layers: QK^T and PV."""
        return 4 * self.heads * self.head_dim * self.layers

    def attention_flops(self, first_pos: int, last_pos: int) -> int:
        """Attention FLOPs of the tokens at positions first_pos..last_pos-1 (position p sees p+1 keys)."""
        keys = (last_pos * (last_pos + 1) - first_pos * (first_pos + 1)) // 2
        return self.key_flops() * keys

    def decode_step_flops(self, batch: int, keys: int) -> int:
        """One decode step: `batch` tokens through every linear and the LM head, attending `keys` keys in all."""
        return batch * (self.token_flops() + self.head_flops()) + self.key_flops() * keys


@dataclass
class WorkloadFlops:
    prefill: float  # prompt tokens, plus the LM head row giving each first token
    decode: float  # every later token

    @property
    def total(self) -> float:
        return self.prefill + self.decode


def workload_flops(workload: Workload, shape: ModelShape) -> WorkloadFlops:
    """Model FLOPs the workload needs: each request processes prompt + output - 1 tokens, samples output rows."""
    prefill = decode = 0.0
    for r in workload.requests:
        p, n = len(r.prompt), r.max_tokens
        prefill += p * shape.token_flops() + shape.attention_flops(0, p) + shape.head_flops()
        decode += (n - 1) * (shape.token_flops() + shape.head_flops()) + shape.attention_flops(p, p + n - 1)
    return WorkloadFlops(prefill, decode)


def best_seconds(fn, seconds: float, trials: int) -> float:
    """Best of `trials` timing windows: on a shared machine the slower windows measure the neighbours."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(trials):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / trials or reps < 3:
            fn()
            reps += 1
        best = min(best, elapsed / reps)
    return best


def gemm_rate(shape: ModelShape, m: int, with_head: bool, seconds_per_shape: float = 0.3, trials: int = 5) -> float:
    """FLOP/s of one step's linears at M rows: every layer's shapes, plus the LM head if every row is sampled.

    Each shape takes the faster of torch's two CPU GEMMs, MKL through `F.linear` and oneDNN with the
    weight prepacked (`PackedLinear`, what kvloom's decoder runs): the ceiling is what the machine
    can do, not what one library does.
    """
    shapes = [(a, b, shape.layers) for a, b in shape.layer_linears()]
    if with_head:
        shapes.append((shape.hidden, shape.vocab, 1))
    flops = seconds = 0.0
    with torch.inference_mode():
        for k, n, count in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            packed = PackedLinear.pack(w)
            best = min(best_seconds(lambda: torch.nn.functional.linear(x, w), seconds_per_shape, trials),
                       best_seconds(lambda: packed(x), seconds_per_shape, trials))
            flops += count * 2 * m * k * n
            seconds += count * best
    return flops / seconds


@dataclass
class Roofline:
    decode_rate: float  # FLOP/s at M=64, all rows through the LM head
    prefill_rate: float  # FLOP/s at M=256, decoder linears only
    workload_flops: WorkloadFlops

    @property
    def seconds(self) -> float:
        return self.workload_flops.prefill / self.prefill_rate + self.workload_flops.decode / self.decode_rate


def measure_roofline(workload: Workload, shape: ModelShape) -> Roofline:
    return Roofline(gemm_rate(shape, DECODE_M, with_head=True), gemm_rate(shape, PREFILL_M, with_head=False),
                    workload_flops(workload, shape))


@dataclass
class DecodeProbe:
    """Decode-only steps of a real run at (about) one batch size: time per step against exact FLOPs."""

    batch: float  # mean requests per step over the selected steps
    context: float  # mean keys per request
    num_steps: int
    step_s: float  # mean wall time of engine.step()
    forward_s: float  # mean time inside runner.execute
    cpu_s: float  # mean process CPU time of a step, all threads
    flops_per_step: float

    @property
    def flops_per_s(self) -> float:
        return self.flops_per_step / self.step_s

    def flops_per_cpu_s(self, threads: int) -> float:
        """FLOP/s had the step had its threads' cores to itself (CPU time / threads as its duration)."""
        return self.flops_per_step / (self.cpu_s / threads)

    @property
    def overhead(self) -> float:
        """Share of a step spent outside the model forward (scheduling, bookkeeping, outputs)."""
        return 1 - self.forward_s / self.step_s


def decode_probe(steps: list[dict], shape: ModelShape, batch: int, tolerance: int = 0) -> DecodeProbe | None:
    """Pick the decode-only steps (one new token per request) whose batch is within `tolerance` of `batch`."""
    chosen = [s for s in steps if s["num_tokens"] == s["batch_size"] and abs(s["batch_size"] - batch) <= tolerance]
    if not chosen:
        return None
    n = len(chosen)
    flops = sum(shape.decode_step_flops(s["batch_size"], s["context_tokens"]) for s in chosen)
    return DecodeProbe(sum(s["batch_size"] for s in chosen) / n,
                       sum(s["context_tokens"] / s["batch_size"] for s in chosen) / n, n,
                       sum(s["step_s"] for s in chosen) / n, sum(s["forward_s"] for s in chosen) / n,
                       sum(s["cpu_s"] for s in chosen) / n, flops / n)


def paired_decode_probe(model: str, threads: int, batch: int = DECODE_M, context: int = 256, rounds: int = 5,
                        steps_per_round: int = 3) -> dict:
    """The decode goal in one window: decode steps at `batch` requests of ~`context` tokens and the GEMM rate
    at M=`batch`, alternated `rounds` times in one fresh process, each side taking its best.

    A run's steps (minutes apart from the GEMM timing, averaged where the GEMM takes its best window)
    mostly measure how busy the shared machine was at each moment; alternating both in one window and
    taking the best of each treats them alike.
    """
    from kvloom.engine.llm_engine import LLMEngine
    from kvloom.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(model=model, max_num_seqs=batch, enable_prefix_caching=False)
    shape = ModelShape.of(engine.model_config)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=rounds * steps_per_round + 8, temperature=0, ignore_eos=True, detokenize=False)
    for i in range(batch):  # random ids: no two prompts share a block
        prompt = torch.randint(100, shape.vocab - 100, (context,), generator=generator).tolist()
        engine.add_request(f"probe-{i}", prompt, params)
    requests = list(engine.requests.values())
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in requests):
        engine.step()
    engine.step()  # the first decode-only step pays any first-use costs
    steps, rates = [], []
    for _ in range(rounds):
        for _ in range(steps_per_round):
            keys = sum(r.num_tokens for r in requests)
            start = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - start, shape.decode_step_flops(batch, keys)))
        rates.append(gemm_rate(shape, batch, with_head=True, seconds_per_shape=0.1, trials=3))
    best_s, best_flops = max(steps, key=lambda s: s[1] / s[0])
    return {"batch": batch, "context": context, "rounds": rounds, "step_s": [s for s, _ in steps],
            "gemm_rates": rates, "best_step_s": best_s, "flops_per_step": best_flops,
            "flops_per_s": best_flops / best_s, "gemm_rate": max(rates),
            "efficiency": best_flops / best_s / max(rates),
            "median_efficiency": median_high(f / s for s, f in steps) / median_high(rates)}


def machine_report(model: str, workload_path: str, threads: int) -> dict:
    """GEMM ceilings at M = 32, 64 and 256 and the workload's roofline; weights as stored.

    Runs in a fresh process (see `bench.in_fresh_process`) so it gets the same threads as the systems.
    """
    from kvloom.engine.model.model_files import resolve_model_dir

    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(model)
    shape = ModelShape.of(ModelConfig.from_dir(model_dir))
    roof = measure_roofline(Workload.load(Path(workload_path)).with_token_ids(model), shape)
    return {"decode_rate": roof.decode_rate, "prefill_rate": roof.prefill_rate, "decode_m": DECODE_M,
            "prefill_m": PREFILL_M, "rate_m32": gemm_rate(shape, 32, with_head=True),
            "prefill_flops": roof.workload_flops.prefill, "decode_flops": roof.workload_flops.decode,
            "roofline_s": roof.seconds,
            "weights_mb": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20,
            "shape": asdict(shape)}


def engine_probes(machine: dict, steps: list[dict], threads: int) -> list[dict]:
    """Decode probes at batch 64 and about 32 from a run's steps, against the GEMM rate at the same M."""
    shape = ModelShape(**machine["shape"])
    probes = []
    for batch, tolerance, rate in ((DECODE_M, 0, machine["decode_rate"]), (32, 4, machine["rate_m32"])):
        probe = decode_probe(steps, shape, batch, tolerance)
        if probe:
            probes.append({**asdict(probe), "target_batch": batch, "flops_per_s": probe.flops_per_s,
                           "overhead": probe.overhead, "gemm_rate": rate, "efficiency": probe.flops_per_s / rate,
                           "cpu_efficiency": probe.flops_per_cpu_s(threads) / rate})
    return probes
