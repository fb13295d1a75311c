"""`python -m kvloom.benchmarks.gpu`: the GPU path against the device's own ceilings, measured in one run.

1. Ceilings: a device-to-device copy's bandwidth (bytes read and written) and a bf16 GEMM's rate.
2. Decode steps (`ModelRunner.execute`: inputs, forward, sampling), eager and (on CUDA) replayed from the
   decode graphs, at a ladder of batch sizes, every request with `--context` tokens of KV, on SmolLM2's shape
   and on an 8B Llama shape (random bf16 weights made on the device), each against its roofline floor:
   max(bytes read / copy bandwidth, FLOPs / GEMM rate).
3. W1 offline (`offline-mixed`) through the engine on `--model-dir` (SmolLM2's config and tokenizer; random
   weights where the folder has none), and its greedy float32 tokens on the device against the CPU engine's.

Writes `<out>/<device>.md` and `.json`. `--quick` shrinks every size so that the whole run takes seconds on a
CPU (the suite runs it that way); its figures say nothing about a GPU.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvloom.benchmarks.random_weights import LLAMA_8B, RandomCheckpoint, fill_missing_weights, write_config
from kvloom.benchmarks.roofline import ModelShape
from kvloom.benchmarks.source_commit import source_commit
from kvloom.engine.model.model_config import ModelConfig

LADDER = [1, 8, 32, 128, 256]
W1_PARITY_PROMPTS, W1_PARITY_TOKENS = 12, 64


@dataclass
class Ceilings:
    copy_gb_s: float  # a device-to-device copy: bytes read plus bytes written, per second (memory traffic)
    read_gb_s: float  # a reduction over the same bytes: bytes read per second
    matmul_tflop_s: float  # the device's GEMM rate in the model's dtype

    @property
    def memory_gb_s(self) -> float:
        """The traffic a step's reads can reach: the better of the two measured."""
        return max(self.copy_gb_s, self.read_gb_s)


@dataclass
class DecodeStep:
    model: str
    graphs: bool  # replayed from a CUDA graph, or eager
    batch: int
    context: int
    step_ms: float  # median of the timed steps
    floor_ms: float  # the roofline floor of the same step
    read_gb: float  # the bytes the step must read (weights, the LM head, every request's KV), in GB
    bound: str  # what sets the floor: "memory" or "compute"


def timed(fn, device: torch.device, repeats: int, warmups: int = 2) -> list[float]:
    """Seconds per call, each call synchronised with the device."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmups):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def release(device: torch.device) -> None:
    """Free what the last engine or runner held before the next one sizes its KV budget from the memory left:
    they hold reference cycles that only the collector breaks, and CUDA keeps freed blocks cached."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_ceilings(device: torch.device, dtype: torch.dtype, quick: bool) -> Ceilings:
    source = torch.empty(1 << (22 if quick else 32), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_s = min(timed(lambda: target.copy_(source), device, 10))
    words = source.view(torch.float32).zero_()  # a float sum: torch's int64-accumulating one read at 0.77 TB/s
    read_s = min(timed(lambda: words.sum(), device, 10))
    del target
    n = 256 if quick else 8192
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    gemm_s = min(timed(lambda: a @ b, device, 10))
    return Ceilings(2 * source.numel() / copy_s / 1e9, source.numel() / read_s / 1e9, 2 * n**3 / gemm_s / 1e12)


def decode_read_bytes(config: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """What one decode step must read: every linear weight and the LM head once, each request's KV once."""
    shape = ModelShape.of(config)
    return ((shape.linear_params + shape.hidden * shape.vocab) * dtype.itemsize
            + batch * context * config.kv_bytes_per_token(dtype))


def decode_floor_s(config: ModelConfig, batch: int, context: int, dtype: torch.dtype, ceilings: Ceilings):
    """(seconds, bound) of one decode step: its reads at the measured memory traffic, or its FLOPs at the GEMM
    rate, whichever is slower."""
    memory_s = decode_read_bytes(config, batch, context, dtype) / (ceilings.memory_gb_s * 1e9)
    compute_s = ModelShape.of(config).decode_step_flops(batch, batch * context) / (ceilings.matmul_tflop_s * 1e12)
    return (memory_s, "memory") if memory_s >= compute_s else (compute_s, "compute")


def decode_steps(name: str, config: ModelConfig, device: torch.device, dtype: torch.dtype, batches: list[int],
                 context: int, ceilings: Ceilings, repeats: int, profile_to: Path | None = None) -> list[DecodeStep]:
    """The ladder's steps, eager and (on CUDA) from graphs; with `profile_to`, where a batch-1 step's device time
    goes, written there (the same runner: its random weights are made once)."""
    from kvloom.engine.model.decoder import FusedDecoder
    from kvloom.engine.request import Request
    from kvloom.engine.runner import ModelRunner
    from kvloom.engine.sampling import SamplingParams
    from kvloom.kernels.backends import select_backend

    decoder = FusedDecoder(config, RandomCheckpoint(config, dtype, device))
    block_size, greedy = 16, SamplingParams(max_tokens=1, temperature=0)
    per_request = -(-(context + 1) // block_size)
    runner = ModelRunner(decoder, config, select_backend("auto", device), max(batches) * per_request, block_size,
                         dtype, device)
    graphs = runner.capture_graphs(max(batches), per_request) if device.type == "cuda" else None
    results = []
    for batch in batches:
        requests = []
        for i in range(batch):
            request = Request(f"r{i}", [i % config.vocab_size] * (context + 1), greedy)
            request.num_computed_tokens = context  # its KV is in the cache: this step decodes one token
            request.block_ids = list(range(i * per_request, (i + 1) * per_request))
            requests.append(request)
        floor_s, bound = decode_floor_s(config, batch, context, dtype, ceilings)
        for mode in ([None, graphs] if graphs else [None]):
            runner.graphs = mode
            step_s = statistics.median(timed(lambda: runner.execute([(r, 1) for r in requests]), device, repeats))
            results.append(DecodeStep(name, mode is not None, batch, context, step_s * 1e3, floor_s * 1e3,
                                      decode_read_bytes(config, batch, context, dtype) / 1e9, bound))
        if batch == 1 and profile_to is not None:
            profile_step(runner, requests, [None, graphs] if graphs else [None], device, profile_to)
    return results


# one of each linear of the 8B Llama shape, (outputs, inputs); a decode step reads 32 layers of the first four
LLAMA_8B_LINEARS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                    "lm_head": (128256, 4096)}
QUANT_ROWS = [1, 8, 32]
# (block_n, block_k, warps, stages) tried at one row against launch_shape's default
QUANT_SWEEP = [(32, 256, 4, 3), (64, 256, 4, 4), (128, 128, 8, 3), (32, 128, 2, 4)]


def quantized_linears(device: torch.device, ceilings: Ceilings, quick: bool) -> dict:
    """The Triton quantized GEMM (GGUF Q4_1 and Q8_0 blocks, bfloat16 activations) against a bfloat16 GEMM of the
    same shape, per linear of the 8B shape and row count, each timed alone (triton's do_bench: device events, the
    L2 flushed before each call); and at one row, a sweep of launch tiles."""
    import torch.nn.functional as F
    import triton

    from kvloom.benchmarks.random_weights import random_gguf_blocks
    from kvloom.kernels.gguf_blocks import QuantType
    from kvloom.kernels.triton_quant_gemm import TritonQuantWeight, launch_shape, multiprocessors, quant_matmul

    def bench(fn) -> float:  # ms
        if device.type != "cuda":
            return statistics.median(timed(fn, device, 3)) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    linears = {"small": (72, 96)} if quick else LLAMA_8B_LINEARS
    generator, results, sweep = torch.Generator().manual_seed(0), [], []
    for name, (n, k) in linears.items():
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for qtype in (QuantType.Q4_1, QuantType.Q8_0):
            weight = TritonQuantWeight.of(random_gguf_blocks(n, k, qtype, generator), qtype, device)
            for rows in ([1] if quick else QUANT_ROWS):
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                quant_ms, dense_ms = bench(lambda: quant_matmul(x, weight)), bench(lambda: F.linear(x, dense))
                results.append({"linear": name, "qtype": qtype.name, "rows": rows, "quant_ms": quant_ms,
                                "bf16_ms": dense_ms, "quant_gb": weight.nbytes / 1e9,
                                "bf16_gb": dense.numel() * 2 / 1e9})
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            for config in ([] if quick else QUANT_SWEEP):
                shape = launch_shape(1, n, k, multiprocessors(device), *config)
                sweep.append({"linear": name, "qtype": qtype.name, "config": list(config), "split": shape.split,
                              "ms": bench(lambda: quant_matmul(x, weight, shape=shape))})
            del weight
        del dense
        release(device)
    return {"gemms": results, "sweep": sweep}


def run_w1(model_dir: Path, device: torch.device, num_requests: int | None, dtypes: tuple[str, ...]) -> dict:
    """W1 offline on the device (float32 and bfloat16), and greedy float32 tokens against the CPU engine's."""
    from kvloom.benchmarks.metrics import summarize
    from kvloom.benchmarks.replay import replay
    from kvloom.benchmarks.workloads import TokenCorpus, load_tokenizer, make_workload, synthetic_text
    from kvloom.engine.llm import LLM
    from kvloom.engine.llm_engine import LLMEngine
    from kvloom.engine.sampling import SamplingParams

    ids = load_tokenizer(str(model_dir)).encode(synthetic_text(60_000), add_special_tokens=False)
    workload = make_workload("offline-mixed", TokenCorpus(torch.tensor(ids).numpy()))
    if num_requests:
        workload.requests[:] = workload.requests[:num_requests]
    out = {"dtypes": list(dtypes)}
    for dtype in dtypes:
        engine = LLMEngine(model=str(model_dir), device=device.type, dtype=dtype, max_num_seqs=256)
        engine.warm_up()
        result = replay(engine, workload)
        out[dtype] = asdict(summarize(f"kvloom {dtype}", result.records, result.wall_s, result.counters))
        del engine
        release(device)
    prompts = [r.prompt[:256] for r in workload.requests[:W1_PARITY_PROMPTS]]
    params = SamplingParams(max_tokens=W1_PARITY_TOKENS, temperature=0, ignore_eos=True)
    tokens = {}
    for where in ("cpu", device.type):
        llm = LLM(str(model_dir), device=where, dtype="float32")
        tokens[where] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        release(device)
    out["greedy_parity"] = {"prompts": len(prompts), "tokens": W1_PARITY_TOKENS,
                            "equal": sum(a == b for a, b in zip(tokens["cpu"], tokens[device.type]))}
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def markdown(report: dict) -> str:
    c = report["ceilings"]
    lines = [f"# kvloom on {report['device']}", "",
             f"Commit {report['commit']}, torch {report['torch']}, `python -m kvloom.benchmarks.gpu "
             f"{report['args']}`.", "",
             f"Ceilings measured in this run: copy {c['copy_gb_s']:.0f} GB/s (read + written), "
             f"read {c['read_gb_s']:.0f} GB/s (a reduction), GEMM {c['matmul_tflop_s']:.1f} TFLOP/s "
             f"({report['dtype']}).", "",
             "| model | step | batch | context | step ms | roofline floor ms | step / floor | bound | read GB/s "
             "| of copy traffic |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["decode"]:
        read_gb_s = s["read_gb"] / (s["step_ms"] / 1e3)
        lines.append(f"| {s['model']} | {'graph' if s['graphs'] else 'eager'} | {s['batch']} | {s['context']} | "
                     f"{s['step_ms']:.3f} | {s['floor_ms']:.3f} | {s['step_ms'] / s['floor_ms']:.2f}x | {s['bound']} "
                     f"| {read_gb_s:.0f} | {read_gb_s / c['copy_gb_s']:.0%} |")
    if report.get("quantized"):
        lines += ["", "Quantized linears (Triton, GGUF blocks, bfloat16 activations) against bfloat16 GEMMs of the 8B "
                      "shape, each alone (do_bench: events, L2 flushed):", "",
                  "| linear | type | rows | quantized ms | bf16 ms | speed-up | quantized GB/s | of copy traffic |",
                  "|---|---|---|---|---|---|---|---|"]
        for g in report["quantized"]["gemms"]:
            gb_s = g["quant_gb"] / (g["quant_ms"] / 1e3)
            lines.append(f"| {g['linear']} | {g['qtype']} | {g['rows']} | {g['quant_ms']:.4f} | {g['bf16_ms']:.4f} | "
                         f"{g['bf16_ms'] / g['quant_ms']:.2f}x | {gb_s:.0f} | {gb_s / c['copy_gb_s']:.0%} |")
        if report["quantized"]["sweep"]:
            lines += ["", "One row, launch tiles swept (block_n, block_k, warps, stages):", "",
                      "| linear | type | tiles | split | ms |", "|---|---|---|---|---|"]
            lines += [f"| {w['linear']} | {w['qtype']} | {tuple(w['config'])} | {w['split']} | {w['ms']:.4f} |"
                      for w in report["quantized"]["sweep"]]
    if report.get("w1"):
        w1 = report["w1"]
        lines += ["", "W1 offline (random weights of SmolLM2's shape, its tokenizer):", "",
                  "| dtype | output tok/s | TTFT p50 s | TPOT p50 ms | TPOT p99 ms |", "|---|---|---|---|---|"]
        for dtype in w1["dtypes"]:
            m = w1[dtype]
            lines.append(f"| {dtype} | {m['output_tok_s']:.0f} | {m['ttft']['p50']:.3f} | "
                         f"{m['tpot']['p50'] * 1e3:.2f} | {m['tpot']['p99'] * 1e3:.2f} |")
        p = w1["greedy_parity"]
        lines += ["", f"Greedy float32 tokens equal to the CPU engine's on {p['equal']} of {p['prompts']} prompts "
                      f"({p['tokens']} tokens each)."]
    return "\n".join(lines) + "\n"


def profile_step(runner, requests: list, modes: list, device: torch.device, out: Path) -> None:
    """Where a decode step's device time goes, eager and replayed: the top kernels of ten steps of each mode."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    tables = []
    for mode in modes:
        runner.graphs = mode
        with profile(activities=activities) as prof:
            timed(lambda: runner.execute([(r, 1) for r in requests]), device, 10, warmups=0)
        tables.append(f"## {'graph' if mode else 'eager'}, ten steps\n" + prof.key_averages().table(
            sort_by="cuda_time_total" if on_cuda else "cpu_time_total", row_limit=25))
    out.write_text("\n\n".join(tables))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", type=Path, help="config and tokenizer of the W1 model (SmolLM2's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke run")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": device_name(device), "commit": source_commit(), "torch": torch.__version__,
              "dtype": str(dtype), "args": " ".join(argv if argv is not None else sys.argv[1:]), "decode": [],
              "quantized": None, "w1": None}
    stem, started = report["device"].replace(" ", "-").lower(), time.perf_counter()

    def write(section: str) -> None:
        """The report so far: a run cut off by its time limit keeps every section it finished."""
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"{stem}.md").write_text(markdown(report))
        print(f"[{time.perf_counter() - started:6.1f}s] {section} done", flush=True)

    ceilings = measure_ceilings(device, dtype, args.quick)
    report["ceilings"] = asdict(ceilings)
    write("ceilings")
    batches, repeats = ([1, 4] if args.quick else LADDER), (3 if args.quick else 20)
    with tempfile.TemporaryDirectory() as scratch:
        shapes = {"8B Llama shape": write_config(Path(scratch) / "8b", LLAMA_8B)}
        if args.model_dir:
            shapes = {"SmolLM2 shape": args.model_dir, **shapes}
        for name, folder in shapes.items():
            config = ModelConfig.from_dir(folder)
            if args.quick:
                config = ModelConfig.from_dir(write_config(Path(scratch) / "quick", {
                    **config.raw, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}))
            context = 32 if args.quick else args.context
            profile_to = args.out / f"profile-{name.split()[0].lower()}.txt"
            report["decode"] += [asdict(s) for s in decode_steps(name, config, device, dtype, batches, context,
                                                                 ceilings, repeats, profile_to)]
            release(device)
            write(f"decode steps and a profile of batch 1, {name}")
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # Triton runs on CPU interpreted only
        report["quantized"] = quantized_linears(device, ceilings, args.quick)
        write("quantized linears")
    if args.model_dir:  # --quick: float32 alone (the same code path)
        report["w1"] = run_w1(fill_missing_weights(args.model_dir), device, 8 if args.quick else None,
                              ("float32",) if args.quick else ("float32", "bfloat16"))
        write("W1 and greedy parity")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
