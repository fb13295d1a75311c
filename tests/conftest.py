"""Shared fixtures: the embedded SmolLM2 model, a tiny random GQA Llama, and greedy references; and the `host`
marker, which skips a test where the host lacks what it needs and says at the end what this host covered."""

import os

# OpenMP waits as kvloom's engines do by default (spinning ~3 ms between ops, engine/cpu_threads.py): under
# OMP_WAIT_POLICY=PASSIVE every op woke its sleeping worker through the kernel, and the in-process engine
# tests ran 28% slower (test_speculative_decoding + test_parity_tiny: 249 s against 180 s, 2-core EPYC).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvloom.benchmarks.tiny_model import build_tiny_llama, write_tiny_gguf  # noqa: E402
from kvloom.kernels.item_pool import torch_threads  # noqa: E402


def _blocked_gemm() -> bool:
    from kvloom.kernels.packed_linear import blocked_kernel_built

    return all(blocked_kernel_built(dtype) for dtype in (torch.float32, torch.bfloat16))


def host_flags() -> frozenset[str]:
    from kvloom.kernels.host_isa import host_isa

    return host_isa().flags


def _isa_variant(variant: str) -> bool:
    from kvloom.kernels.cpu_extensions import isa_variants
    from kvloom.kernels.host_isa import host_isa

    return variant in isa_variants(host_isa())


# what a host-dependent test needs -> (what it is, whether this host has it)
HOST_FEATURES = {
    "blocked-gemm": ("kvloom's blocked GEMM (built on AVX-512 CPUs)", _blocked_gemm),
    "avx512-build": ("kernels built for AVX-512 (x86-64-v4) run here", lambda: _isa_variant("avx512")),
    "avx2-build": ("kernels built for AVX2 (x86-64-v3) run here", lambda: _isa_variant("avx2")),
    "x86-64-build": ("kernels built for baseline x86-64 run here", lambda: _isa_variant("generic")),
    "avx512-bf16": ("AVX-512 bfloat16 dot products (VDPBF16PS)", lambda: {"avx512_bf16", "avx512bw"} <= host_flags()),
    "avx512-vnni": ("AVX-512 int8 dot products (VPDPBUSD)", lambda: {"avx512_vnni", "avx512bw"} <= host_flags()),
    "proc-threads": ("Linux /proc per-thread files", lambda: os.path.exists("/proc/self/task")),
    "sched-batch": ("Linux scheduling classes", lambda: hasattr(os, "SCHED_BATCH")),
    "cuda": ("a CUDA device", torch.cuda.is_available),
    "two-cuda": ("two CUDA devices", lambda: torch.cuda.device_count() >= 2),
}
_host_runs: dict[str, Counter] = {feature: Counter() for feature in HOST_FEATURES}


def host_has(feature: str) -> bool:
    return HOST_FEATURES[feature][1]()


def pytest_configure(config):
    config.addinivalue_line("markers", "host(feature): needs one of HOST_FEATURES; skipped where the host lacks it")
    config.addinivalue_line("markers", "triton_kernels: Triton kernels, run on CUDA or in Triton's interpreter")


# Triton kernel files (marked `triton_kernels`) run on CUDA, or on CPU in Triton's interpreter: such a file sets
# TRITON_INTERPRET=1 before it imports triton, and the flag takes only where nothing imported triton earlier in the
# process (`@triton.jit` picks interpreter or compiler when it decorates, triton's own helpers at its first import).
# Where something did, the file's tests are skipped here and its fresh-process test runs the file in a new process.
FRESH_PROCESS_TEST = "test_whole_file_in_a_fresh_interpreter_process"


def _triton_cannot_run_here() -> bool:
    if torch.cuda.is_available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(tl.sum, InterpretedFunction)


@pytest.fixture(autouse=True)
def _triton_kernels_runnable(request):
    if (request.node.get_closest_marker("triton_kernels") and request.node.name != FRESH_PROCESS_TEST
            and _triton_cannot_run_here()):
        pytest.skip("triton was imported before TRITON_INTERPRET=1; run in a fresh process instead")


@pytest.fixture
def rerun_in_fresh_interpreter():
    """Runs a Triton kernel file again in a new process with TRITON_INTERPRET=1, where this one cannot interpret
    (skipped where it can: the file's tests run here)."""
    import subprocess
    import sys

    if not _triton_cannot_run_here():
        pytest.skip("the kernels already run in this process")

    def rerun(path: str) -> None:
        done = subprocess.run([sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"],
                              cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    return rerun


def pytest_collection_modifyitems(session, config, items):
    """Modules on the session's Ray cluster run last, each whole and in file order: the cluster starts with the
    first of them, so the rest of the suite (and the tests that start clusters of their own) runs without its
    idle processes taking a share of the cores. Last of all, those serving one app (their module's `SHARED_APP`,
    the same config), one after another: `deploy` keeps the app from one to the next."""
    on_cluster = {item.module for item in items if "ray_serve" in item.fixturenames}
    # stable: file order within each group
    items.sort(key=lambda item: (item.module in on_cluster, getattr(item.module, "SHARED_APP", "")))


def pytest_report_header(config):
    from kvloom.kernels.host_isa import auto_cpu_dtype, host_isa

    isa = host_isa()
    found = ", ".join(f"{name} {'yes' if host_has(name) else 'no'}" for name in HOST_FEATURES)
    return [f"host: {isa.describe()}; {os.cpu_count()} cores; report key {isa.report_key}; dtype auto on CPU: "
            f"{auto_cpu_dtype(isa)}", f"host features: {found}"]


def pytest_runtest_setup(item):
    features = [mark.args[0] for mark in item.iter_markers("host")]
    item.user_properties.append(("host_features", features))  # the report carries them to the summary
    for feature in features:
        if not host_has(feature):
            pytest.skip(f"needs {HOST_FEATURES[feature][0]}, which this host lacks")


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.skipped):
        for feature in dict(report.user_properties).get("host_features", []):
            _host_runs[feature]["skipped" if report.skipped else "ran"] += 1


def pytest_terminal_summary(terminalreporter):
    from kvloom.kernels.host_isa import host_isa

    terminalreporter.section("host-dependent tests")
    terminalreporter.write_line(f"host: {host_isa().describe()}")
    for feature, (what, _) in HOST_FEATURES.items():
        runs = _host_runs[feature]
        terminalreporter.write_line(f"{feature:<13} {'present' if host_has(feature) else 'absent ':<8} "
                                    f"{runs['ran']:>4} ran {runs['skipped']:>4} skipped  ({what})")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def build_tiny_model():
    """build_tiny_llama itself, for tests that need another family or seed."""
    return build_tiny_llama


@pytest.fixture
def kernel_threads():
    """`use(threads, pool)`: kvloom's kernels run on `threads` threads of kvloom's item pool (pool=True) or of
    torch's OpenMP team; the previous setting comes back after the test."""
    from kvloom.kernels import item_pool

    saved_pool, saved_torch = item_pool.pool_threads(), torch.get_num_threads()

    def use(threads: int, pool: bool) -> None:
        item_pool.use_item_pool(pool)
        item_pool.set_intra_op_threads(threads)

    yield use
    use(saved_pool or saved_torch, bool(saved_pool))


@pytest.fixture
def same_on_any_thread_count(kernel_threads):
    """`check(fn)`: whether `fn()` gives the same bits on 1, 2 and 3 threads of torch's team and of kvloom's item
    pool (a kernel's work items go to whichever thread asks first; each output must still be one thread's sum)."""
    def check(fn) -> bool:
        results = []
        for pool in (False, True):
            for threads in (1, 2, 3):
                kernel_threads(threads, pool)
                results.append(fn())
        return all(torch.equal(results[0], r) for r in results[1:])
    return check


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """`write(arch, down_type)`: writes a tiny GGUF model (converted into a cache under tmp_path), returns its
    path."""
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))

    def write(arch: str = "llama", down_type: str = "Q8_0") -> str:
        path = tmp_path / f"{arch}-{down_type}.gguf"
        write_tiny_gguf(path, arch, down_type)
        return str(path)
    return write


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from kvloom.engine.model.model_files import resolve_model_dir

    return resolve_model_dir("smollm2")


def keep_layers(model_dir: Path, path: Path, layers: list[int]) -> Path:
    """A checkpoint of `model_dir` with only the decoder layers `layers` (renumbered from 0): the same
    vocabulary, tokenizer, embedding and attention shapes, a fraction of the compute."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    kept = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if not name.startswith("model.layers."):
            kept[name] = tensor
        elif (layer := int(name.split(".")[2])) in layers:
            kept[name.replace(f"model.layers.{layer}.", f"model.layers.{layers.index(layer)}.", 1)] = tensor
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": len(layers)}))
    for file in model_dir.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def smollm2_4_layers_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2 cut to its first two and last two layers, for tests that compare kvloom with itself (speculation
    with and without, tensor parallelism against one rank): its real tokenizer and KV shapes, diverse (if
    meaningless) text, about a third of the compute of all 30 layers."""
    return keep_layers(smollm2_dir, tmp_path_factory.mktemp("smollm2-4-layers"), [0, 1, 28, 29])


SYSTEM = (
    "You are a careful assistant for a team of engineers. Answer precisely, prefer short "
    "sentences, show small examples when they help, and say when you are unsure."
)
PASSAGE = (
    "The river rose slowly through the night, covering the lower fields first and then the road "
    "that led to the old mill. By morning the villagers had moved their animals to the hill, "
    "and the baker was handing out bread from the back of a cart. "
)
QUESTIONS = [
    "What is 17 times 3?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is to a beginner.",
    "Give me a short recipe for pancakes.",
    "Why do cats purr?",
    "Translate 'good morning' into French and Spanish.",
    "List four planets of the solar system.",
    "What does HTTP stand for?",
    "Summarize the story below in one sentence.\n" + PASSAGE * 3,
    "What happened to the road? Read this first:\n" + PASSAGE * 8,
    "Who helped the villagers, according to this text?\n" + PASSAGE * 11,
]
RAW = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 5, 8,"]


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_dir) -> list[list[int]]:
    """16 varied SmolLM2 prompts: 12 chat-templated with one system prompt (5 to ~600 tokens), then 4 raw."""
    from kvloom.engine.model.model_loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    chats = [list(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
             for q in QUESTIONS]
    return chats + [tokenizer.encode(text) for text in RAW]


def every_core():
    """torch on every core for a transformers reference: an `LLMEngine` built earlier in this process left the
    main thread's torch ops on one thread (its own kernels run on kvloom's item pool, kernels/item_pool.py), and the
    SmolLM2 parity reference then took 25 s on one core instead of 19 s on two."""
    return torch_threads(len(os.sched_getaffinity(0)))


@pytest.fixture(scope="session", name="every_core")
def every_core_fixture():
    return every_core


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, batch: int = 1) -> list[list[int]]:
    """transformers `generate`, greedy: the reference our engine must match token for token. `batch` > 1 runs
    prompts of similar length together, left-padded under an attention mask (SmolLM2's 16 parity prompts: 30 s in
    batches of 8 against 56 s one by one, the same tokens); the tiny random models' near ties stay at batch 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    eos = model.generation_config.eos_token_id
    results: dict[int, list[int]] = {}
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with torch.inference_mode(), every_core():
        for start in range(0, len(prompts), batch):
            group = by_length[start:start + batch]
            width = max(len(prompts[i]) for i in group)
            ids = torch.tensor([[eos] * (width - len(prompts[i])) + prompts[i] for i in group])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in group])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
            for i, row in zip(group, out[:, width:].tolist()):
                results[i] = row[:row.index(eos) + 1] if eos in row else row
    return [results[i] for i in range(len(prompts))]


def run_to_completion(engine, prompts, params, arrivals: dict[int, list[int]] | None = None):
    """Drive an LLMEngine step by step; `arrivals` maps step number -> prompt indices added then.

    Returns the finished outputs in prompt order and the peak-usage bound checked every step.
    """
    arrivals = arrivals or {0: list(range(len(prompts)))}
    pending = dict(arrivals)
    finished = {}
    step = 0
    while pending or engine.has_unfinished():
        for index in pending.pop(step, []):
            engine.add_request(f"r{index}", prompts[index], params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
        assert step < 100_000, "engine made no progress"
    return [finished[f"r{i}"] for i in range(len(prompts))]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of the counts against `probs` (cells expecting fewer than 5 pooled into one): its p-value,
    the chi-square survival function, is the regularized upper incomplete gamma function."""
    expected = probs.double() / probs.sum() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)]).double()
    expected = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    degrees = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


@pytest.fixture(scope="session", name="chi_square_p")
def chi_square_fixture():
    return chi_square_p


SIZED_BY_VALUES = {"nonzero", "masked_select", "_local_scalar_dense"}  # ops whose result needs the values on the host


@pytest.fixture
def host_reads(monkeypatch):
    """`with host_reads() as reads:` lists what in the block reads tensor values on the host: `tolist`, `numpy`,
    `cpu`, a Python scalar of a tensor (`item`, `bool`, `int`, `float`), an op whose result's size depends on
    values (nonzero, a boolean index). On an accelerator each is a device-to-host copy that waits for the device;
    on CPU tensors the reads are counted all the same."""
    from contextlib import contextmanager

    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[str] = []

    class ValueReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            indices = args[1] if name.startswith("index") and isinstance(args[1], (list, tuple)) else ()
            boolean_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
            if name in SIZED_BY_VALUES or boolean_index:
                reads.append(name)
            return func(*args, **(kwargs or {}))

    def spy(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return read

    @contextmanager
    def counting():
        with monkeypatch.context() as patch, ValueReads():
            for name in ("tolist", "numpy", "cpu"):
                patch.setattr(torch.Tensor, name, spy(name))
            yield reads

    return counting


@pytest.fixture(scope="session")
def greedy_reference():
    return hf_greedy


@pytest.fixture(scope="session")
def drive():
    return run_to_completion


@pytest.fixture(scope="session")
def ray_serve():
    """A local Ray cluster with Serve listening on a free loopback port; yields the base URL."""
    import ray
    from ray import serve

    from kvloom.cluster.ports import free_port

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


_deployed: dict[str, tuple[str, float]] = {}  # app name -> (the config `deploy` gave it, Serve's deployment time)


def deploy(config, app_name: str = "kvloom", timeout_s: float = 180):
    """Deploy a ClusterConfig and wait until the router sees exactly its replicas (also when scaling down). An app
    this deployed with the same config, which Serve has not deployed again since and whose replicas all report, is
    kept: modules serving one config (a `SHARED_APP`, run one after another) start it once, ~10 s each."""
    import time

    from ray import serve

    from kvloom.cluster import app

    config_json, replicas = config.model_dump_json(), app.expected_replicas(config)
    running = serve.status().applications.get(app_name)
    if running is not None and _deployed.get(app_name) == (config_json, running.last_deployed_time_s):
        router = serve.get_deployment_handle(app.ROUTER_NAME, app_name)
        if running.status == "RUNNING" and len(router.replica_stats.remote().result()) == replicas:
            return router
    router = app.deploy(config, app_name, timeout_s)
    deadline = time.monotonic() + timeout_s
    while len(router.replica_stats.remote().result()) != replicas:
        assert time.monotonic() < deadline, "replicas did not report in time"
        time.sleep(0.25)
    _deployed[app_name] = (config_json, serve.status().applications[app_name].last_deployed_time_s)
    return router


@pytest.fixture(scope="session")
def deploy_app():
    return deploy


def router_pid(app_name: str = "kvloom") -> int | None:
    import ray._private.state as ray_state

    return next((a["Pid"] for a in ray_state.actors(actor_state_name="ALIVE").values()
                 if a["Name"].startswith(f"SERVE_REPLICA::{app_name}#Router#")), None)


def kill_router(ready, timeout_s: float = 120) -> None:
    """SIGKILL the router's process and wait for the one Serve starts in its place to be `ready()`."""
    import signal
    import time

    killed = router_pid()
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while router_pid() in (killed, None) or not ready():
        assert time.monotonic() < deadline, "the router did not come back"
        time.sleep(0.25)


@pytest.fixture(scope="session")
def router_killer():
    return kill_router


def start_serve(directory: Path, config_text: str, *args: str):
    """`kvloom serve` on `config_text` (written into `directory`), in its own session and its own Ray cluster (not
    the tests' one); returns the process and the file its console goes to."""
    import subprocess
    import sys

    config = directory / "serve.yaml"
    config.write_text(config_text)
    log = config.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    process = subprocess.Popen([sys.executable, "-m", "kvloom.cluster.cli", "serve", "--config", str(config), *args],
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, log


@pytest.fixture(scope="session")
def serve_process():
    return start_serve
