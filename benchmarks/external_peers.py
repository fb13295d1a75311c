"""Whole serving systems as peers, each run as its own process tree on the same workload and prompt ids:
vLLM's CPU build (its offline `LLM`, and `vllm serve` over HTTP), llama.cpp's `llama-server` over HTTP,
and kvloom's own `kvloom serve` over HTTP (the path a user takes, measured the same way as the others).

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own and is driven
as a subprocess (`peer_drivers/vllm_offline.py` for the offline engine); llama.cpp is built from the
source the `llama-cpp-python` sdist carries. Both are set up on demand by the scripts in `peer_setup/`;
a peer that is not set up is reported as such, with the one command that sets it up, and the run goes
on. Every system's peak RSS is its whole process tree's (engine cores, Ray's daemons, workers).
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from kvloom.benchmarks.harness import BenchSettings, SystemResult, SystemSpec, request_rows
from kvloom.benchmarks.http_replay import replay_http
from kvloom.benchmarks.metrics import BatchCounters, RequestRecord, summarize
from kvloom.benchmarks.process_tree import PeakTreeRSS, stop_tree, tree_rss_mb, wait_for
from kvloom.benchmarks.serving_cpu import CLIENT, cpu_by_role, own_cpu_seconds, thread_cpu_seconds
from kvloom.benchmarks.workloads import Workload
from kvloom.cluster.ports import free_port
from kvloom.engine.model.model_files import embedded_gguf, resolve_model_dir
from kvloom.kernels.host_isa import host_isa

HERE = Path(__file__).parent
KINDS = ("vllm", "vllm-serve", "llama.cpp", "kvloom-serve")
SERVED_NAME = "bench"
SERVER_START_S = 600.0  # vLLM's first start compiles its kernels for this CPU


def peers_root() -> Path:
    return Path(os.environ.get("KVLOOM_PEERS_DIR", Path.home() / ".cache" / "kvloom" / "peers"))


@dataclass(frozen=True)
class PeerInstall:
    """Where a peer's set-up script leaves it, and the one command that makes it."""

    executable: Path
    setup_command: str

    @property
    def ready(self) -> bool:
        return self.executable.is_file()

    @property
    def missing(self) -> str:
        return f"not set up: run `{self.setup_command}`"


def vllm_install() -> PeerInstall:
    return PeerInstall(peers_root() / "vllm" / "bin" / "python", "bash benchmarks/peer_setup/vllm.sh")


def llama_cpp_install() -> PeerInstall:
    """llama-server, built with -march=native: the build is keyed by this CPU's instruction set."""
    return PeerInstall(peers_root() / f"llama.cpp-{host_isa().build_key}" / "bin" / "llama-server",
                       "bash benchmarks/peer_setup/llama_cpp.sh")


def llama_gguf(dtype: str) -> Path:
    """The embedded model as a GGUF file of this type: q4_1 is the embedded file itself (the one kvloom loads);
    f16, bf16, q8_0 and q4_0 are made by peer_setup/llama_cpp.sh."""
    if dtype == "q4_1":
        return embedded_gguf("smollm2")
    return peers_root() / "gguf" / f"smollm2-{dtype}.gguf"


# ---- command lines (pure: unit-tested without the peers installed) -------------------------------------
SMALL_HOST_CPUS = 4  # on hosts up to this size vLLM's CPU build is best with no CPU reserved for its front end


def cpu_list(cpus: list[int]) -> str:
    """CPU ids as vLLM's `VLLM_CPU_OMP_THREADS_BIND` takes them: ranges joined by commas (`0-1`, `0-3,6`)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_preload() -> list[Path]:
    """The libraries vLLM's CPU guide asks to preload, where they are: TCMalloc (a system package) and Intel
    OpenMP (its wheel installs `libiomp5.so` into vLLM's environment)."""
    return [lib for lib in (TCMALLOC, vllm_install().executable.parent.parent / "lib" / "libiomp5.so") if lib.is_file()]


def vllm_env(settings: BenchSettings, cpus: list[int] | None = None,
             preload: list[Path] | None = None) -> dict[str, str]:
    """vLLM's CPU build at its documented best on this host: its OpenMP threads bound to every CPU this process may
    use, and on small hosts none reserved for its front end (its default binding keeps one back: half of a 2-core
    host), the allocator and OpenMP runtime its guide preloads (`vllm_preload()` by default), and passive OpenMP
    waits, with which it ran best on the AMX host (W1 float32 203 out tok/s against 113 at its defaults;
    docs/performance.md). The KV budget, kvloom's, goes on its command line in bytes (`vllm_engine_flags`)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    preload = vllm_preload() if preload is None else preload
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus), "OMP_WAIT_POLICY": "PASSIVE"}
    if len(cpus) <= SMALL_HOST_CPUS:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if preload:
        env["LD_PRELOAD"] = ":".join(str(lib) for lib in preload)
    return env


def vllm_engine_flags(settings: BenchSettings, dtype: str, max_model_len: int) -> list[str]:
    """The shared settings as vLLM's flags (its offline drivers take `vllm serve`'s names). The KV budget in bytes:
    `VLLM_CPU_KVCACHE_SPACE` takes whole GiB only (vLLM 0.32 reads it with int())."""
    return ["--dtype", dtype, "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens), "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]


def vllm_offline_command(python: Path, workload: Path, model_dir: Path, out: Path, settings: BenchSettings,
                         dtype: str, max_model_len: int, speculative_config: dict | None = None,
                         lora: dict | None = None) -> list[str]:
    """`lora`: adapters by name, max_loras, max_cpu_loras, max_lora_rank (vLLM's own knobs of those names)."""
    command = [str(python), str(HERE / "peer_drivers" / "vllm_offline.py"), str(workload), str(model_dir), str(out),
               *vllm_engine_flags(settings, dtype, max_model_len)]
    if speculative_config:
        command += ["--speculative-config", json.dumps(speculative_config)]
    if lora:
        command += ["--lora", json.dumps(lora)]
    return command + ([] if settings.enable_prefix_caching else ["--no-prefix-caching"])


def vllm_server_command(python: Path, model_dir: Path, port: int, settings: BenchSettings, dtype: str,
                        max_model_len: int, lora: dict | None = None) -> list[str]:
    """`vllm serve` as its module: the installed `vllm` script fails on the `vllm-cpu` package name. `lora` as
    for `vllm_offline_command`: each adapter served under its name."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               *vllm_engine_flags(settings, dtype, max_model_len), "--seed", "0"]
    if lora:
        command += ["--enable-lora", "--max-loras", str(lora["max_loras"]), "--max-cpu-loras",
                    str(lora["max_cpu_loras"]), "--max-lora-rank", str(lora["max_lora_rank"]),
                    "--lora-modules", *(f"{name}={path}" for name, path in lora["adapters"].items())]
    return command + ([] if settings.enable_prefix_caching else ["--no-enable-prefix-caching"])


def llama_server_command(binary: Path, gguf: Path, port: int, settings: BenchSettings, max_model_len: int) -> list[str]:
    """Continuous batching over `max_num_seqs` slots; llama-server splits its context evenly among them."""
    return [str(binary), "-m", str(gguf), "--alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(settings.max_num_seqs), "--ctx-size", str(settings.max_num_seqs * max_model_len),
            "--cont-batching", "--batch-size", str(settings.max_num_batched_tokens),
            "--threads", str(settings.threads), "--threads-batch", str(settings.threads)]


def kvloom_serve_config(settings: BenchSettings, port: int, dtype: str) -> dict:
    """`kvloom serve`'s YAML for the benchmark: the shipped default with the shared settings."""
    shipped = yaml.safe_load((HERE.parent / "configs" / "local-cpu.yaml").read_text())
    shipped["served_model_name"] = SERVED_NAME
    shipped["engine"].update(model=settings.model, dtype=dtype, max_num_seqs=settings.max_num_seqs,
                             max_num_batched_tokens=settings.max_num_batched_tokens,
                             kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
                             enable_prefix_caching=settings.enable_prefix_caching)
    shipped["http"]["port"] = port
    return shipped


def kvloom_serve_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "kvloom.cluster.cli", "serve", "--config", str(config)]


def parse_vllm_offline(doc: dict, workload: Workload) -> tuple[list[RequestRecord], float]:
    """The offline driver's document as records: all requests arrive at 0; first and last token times are
    vLLM's own per-request stats where the driver has them (else both are the wall time)."""
    wall = float(doc["wall_s"])
    outputs = doc["outputs"]
    missing = [r.request_id for r in workload.requests if r.request_id not in outputs]
    if missing:
        raise ValueError(f"vLLM's output lacks {len(missing)} request(s), first {missing[0]}")
    times = doc.get("times", {})
    return [RequestRecord(r.request_id, len(r.prompt), list(outputs[r.request_id]), 0.0,
                          *times.get(r.request_id, (wall, wall))) for r in workload.requests], wall


def external_systems(kinds: list[str], isa=None) -> list[SystemSpec]:
    """The specs for the named external peers, at the dtypes the goals compare: vLLM offline in bfloat16
    (its CPU default) and float32, with kvloom's continuous engine in float32 beside them (the default
    strategy runs dtype auto); `vllm serve` at its default, bfloat16; llama.cpp at each GGUF type that may be
    its fastest here, the goal taking the fastest: its 16-bit one (BF16 where the CPU multiplies it, else F16),
    and the quantized Q8_0 and Q4_0 (whose outputs differ from the model's: their weights are rounded to 8 and
    4 bits; Q4_0 was llama.cpp's fastest on W1 on an AVX2-only EPYC, Q4_K_M slower than F16 there);
    `kvloom serve` at its default, dtype auto.
    On a CPU without bfloat16 arithmetic vLLM runs in float32 only, offline and served: its bfloat16
    default is emulated there (measured on an AVX2-only EPYC: ~40 prompt tok/s and ~1 output tok/s on
    W1, 600 s limit hit with every request unfinished), so float32 is its best and the one compared."""
    fast_bf16 = (isa or host_isa()).fast_bfloat16
    vllm_dtypes = {"bf16": "bfloat16", "fp32": "float32"} if fast_bf16 else {"fp32": "float32"}
    served = "bf16" if fast_bf16 else "fp32"
    table = {
        "vllm": [*(SystemSpec(f"vllm-{short}", "vllm", engine={"dtype": dtype}) for short, dtype in vllm_dtypes.items()),
                 SystemSpec("continuous-fp32", "kvloom", strategy="continuous", engine={"dtype": "float32"})],
        "vllm-serve": [SystemSpec(f"vllm-serve-{served}", "vllm-serve", engine={"dtype": vllm_dtypes[served]})],
        "llama.cpp": [SystemSpec(f"llama.cpp-{gguf}", "llama.cpp", engine={"dtype": gguf})
                      for gguf in ("bf16" if fast_bf16 else "f16", "q8_0", "q4_0")],
        "kvloom-serve": [SystemSpec("kvloom-serve", "kvloom-serve")],
    }
    return [spec for kind in kinds for spec in table[kind]]


# ---- running ---------------------------------------------------------------------------------------------
def _max_model_len(workload: Workload) -> int:
    return max(len(r.prompt) + r.max_tokens for r in workload.requests)


@dataclass
class EngineCounters:
    """kvloom serve's engine counters over all replicas, from its /metrics (`kvloom:engine_*`)."""

    steps: float = 0.0
    requests: float = 0.0  # computed, summed over steps
    seconds: float = 0.0  # spent in steps

    @classmethod
    def read(cls, base: str) -> "EngineCounters":
        return cls.parse(httpx.get(f"{base}/metrics", timeout=10).text)

    @classmethod
    def parse(cls, metrics_text: str) -> "EngineCounters":
        names = {"kvloom:engine_steps_total": "steps", "kvloom:engine_step_requests_total": "requests",
                 "kvloom:engine_step_seconds_total": "seconds"}
        counters = cls()
        for line in metrics_text.splitlines():
            field = names.get(line.split("{", 1)[0].split(" ", 1)[0])
            if field:
                setattr(counters, field, getattr(counters, field) + float(line.rsplit(" ", 1)[1]))
        return counters

    def __sub__(self, before: "EngineCounters") -> "EngineCounters":
        return EngineCounters(self.steps - before.steps, self.requests - before.requests,
                              self.seconds - before.seconds)


def _result(spec: SystemSpec, records: list[RequestRecord], wall: float, peak_mb: float, loaded_mb: float | None,
            elapsed: float, with_outputs: bool, engine: EngineCounters | None = None) -> SystemResult:
    batch = BatchCounters(int(engine.steps), int(engine.requests)) if engine else None
    metrics = summarize(spec.name, records, wall, batch, engine_busy_s=engine.seconds if engine else None)
    metrics.peak_rss_mb = peak_mb
    metrics.notes.append("peak RSS: the whole process tree's")
    outputs = {r.request_id: r.output_token_ids for r in records} if with_outputs else {}
    return SystemResult(spec, "ok", metrics, request_rows(records), outputs, elapsed, loaded_mb)


def _not_set_up(spec: SystemSpec, install: PeerInstall) -> SystemResult:
    return SystemResult(spec, install.missing, None, [], {}, 0.0)


def run_vllm_offline(spec: SystemSpec, workload: Workload, settings: BenchSettings, out_dir: Path,
                     limit_s: float) -> SystemResult:
    install = vllm_install()
    if not install.ready:
        return _not_set_up(spec, install)
    workload_path = workload.save(out_dir / "workload.jsonl")  # token ids, the stated subset if any
    out = out_dir / "vllm-output.json"
    out.unlink(missing_ok=True)
    command = vllm_offline_command(install.executable, workload_path, resolve_model_dir(settings.model), out,
                                   settings, spec.engine.get("dtype", "bfloat16"), _max_model_len(workload),
                                   spec.engine.get("speculative_config"), spec.engine.get("lora"))
    start = time.monotonic()
    with (out_dir / "log.txt").open("w") as log:
        process = subprocess.Popen(command, env={**os.environ, **vllm_env(settings)}, stdout=log, stderr=log,
                                   start_new_session=True)
        with PeakTreeRSS(process.pid) as rss:
            try:
                process.wait(limit_s)
            except subprocess.TimeoutExpired:
                stop_tree(process)
                return SystemResult(spec, "timeout", None, [], {}, time.monotonic() - start)
    if process.returncode != 0 or not out.exists():
        return SystemResult(spec, f"error: exit code {process.returncode} (see {out_dir / 'log.txt'})", None, [], {},
                            time.monotonic() - start)
    doc = json.loads(out.read_text())
    records, wall = parse_vllm_offline(doc, workload)
    result = _result(spec, records, wall, rss.peak_mb, None, time.monotonic() - start, with_outputs=True)
    result.metrics.spec_decode = doc.get("spec_decode")
    return result


def server_command(spec: SystemSpec, settings: BenchSettings, max_model_len: int, port: int, scratch: Path):
    """(command, environment, install) for an HTTP server, or None for the install when nothing is needed."""
    dtype = spec.engine.get("dtype")
    if spec.kind == "vllm-serve":
        install = vllm_install()
        return ([*vllm_server_command(install.executable, resolve_model_dir(settings.model), port, settings,
                                      dtype or "bfloat16", max_model_len, spec.engine.get("lora")), *spec.extra_args],
                vllm_env(settings), install)
    if spec.kind == "llama.cpp":
        install = llama_cpp_install()
        gguf = llama_gguf(dtype or "f16")
        if not gguf.is_file():
            install = PeerInstall(gguf, install.setup_command)
        return llama_server_command(install.executable, gguf, port, settings, max_model_len), {}, install
    config = scratch / "kvloom-serve.yaml"
    serve_config = kvloom_serve_config(settings, port, dtype or "auto")
    serve_config["engine"].update({key: value for key, value in spec.engine.items() if key != "dtype"})  # lora, ...
    config.write_text(yaml.safe_dump({**serve_config, **spec.serve}))
    return kvloom_serve_command(config), {}, None


class ServerUnavailable(Exception):
    """The server is not set up (the message names its set-up command) or did not start."""


@dataclass
class Server:
    base: str  # http://127.0.0.1:<port>
    process: subprocess.Popen
    rss: PeakTreeRSS  # sampled from the start, start-up included


@contextmanager
def running_server(spec: SystemSpec, settings: BenchSettings, max_model_len: int, log_path: Path) -> Iterator[Server]:
    """Start an HTTP server as its own process tree, wait for /health, yield it; stop the whole tree after.
    Raises ServerUnavailable when it is not set up or does not start."""
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        command, env, install = server_command(spec, settings, max_model_len, port, Path(scratch))
        if install is not None and not install.ready:
            raise ServerUnavailable(install.missing)
        base = f"http://127.0.0.1:{port}"
        with log_path.open("w") as log:
            process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=log,
                                       start_new_session=True)
            try:
                with PeakTreeRSS(process.pid) as rss:
                    if not wait_for(lambda: healthy(base) or process.poll() is not None, SERVER_START_S) \
                            or process.poll() is not None:
                        raise ServerUnavailable(f"error: the server did not start (see {log_path})")
                    yield Server(base, process, rss)
            finally:
                stop_tree(process)


# a replay against a started server, given the seconds left: its records, wall time and its own CPU seconds
Replay = Callable[[Server, float], tuple[list[RequestRecord], float, float]]


def run_served(spec: SystemSpec, workload: Workload, settings: BenchSettings, out_dir: Path, limit_s: float,
               replay: Replay, client: str = CLIENT) -> SystemResult:
    """Start the server, wait for /health, run `replay` on it, stop the server. Around a `kvloom serve` replay the
    engine's counters and every process's CPU by role are read too (`client` names the replay's own share)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        with running_server(spec, settings, _max_model_len(workload), out_dir / "log.txt") as server:
            loaded_mb = tree_rss_mb(server.process.pid)
            left = max(limit_s - (time.monotonic() - start), 60.0)
            ours = spec.kind == "kvloom-serve"
            engine = EngineCounters.read(server.base) if ours else None
            threads = thread_cpu_seconds() if ours else None
            records, wall, client_s = replay(server, left)
            if ours:
                cpu = cpu_by_role(threads, thread_cpu_seconds(), os.getpid(), client_s, client)
                time.sleep(1.5)  # replicas push stats every 0.5 s: the run's last steps reach the router
                engine = EngineCounters.read(server.base) - engine
    except ServerUnavailable as exc:
        return SystemResult(spec, str(exc), None, [], {}, time.monotonic() - start)
    result = _result(spec, records, wall, server.rss.peak_mb, loaded_mb, time.monotonic() - start,
                     with_outputs=False, engine=engine)
    if ours:
        result.metrics.cpu_by_role = cpu
    return result


def run_http_peer(spec: SystemSpec, workload: Workload, settings: BenchSettings, out_dir: Path,
                  limit_s: float) -> SystemResult:
    """The workload over streaming HTTP, this process the client."""
    def over_http(server: Server, left_s: float) -> tuple[list[RequestRecord], float, float]:
        client = own_cpu_seconds()
        records, wall = asyncio.run(replay_http(server.base, workload, SERVED_NAME, timeout_s=left_s))
        return records, wall, own_cpu_seconds() - client

    return run_served(spec, workload, settings, out_dir, limit_s, over_http)


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_external(spec: SystemSpec, workload_path: Path, settings: BenchSettings, out_dir: Path,
                 limit_s: float) -> SystemResult:
    workload = Workload.load(workload_path).with_token_ids(settings.model)
    if spec.num_requests is not None:
        workload = workload.head(spec.num_requests)
    if spec.kind == "vllm":
        return run_vllm_offline(spec, workload, settings, out_dir, limit_s)
    return run_http_peer(spec, workload, settings, out_dir, limit_s)
