"""Builds kvloom's C++ CPU kernels once per machine with torch's JIT extension loader.

Sources sit next to this file and register their ops as `torch.ops.kvloom.*` (TORCH_LIBRARY, ATen's
own headers: a fresh build takes seconds, where pybind's torch/extension.h alone costs half a
minute). Builds live under ~/.cache/torch_extensions in a folder per Python, torch version, CPU
instruction set and hash of the sources' content, and build from a copy of the source inside that
folder: two checkouts of the same code on one machine (a CI clone beside a working tree) share one
build instead of rebuilding each other's (torch's loader keys a build by the source's path too).
Set-up (`./dev.sh`) runs `python -m kvloom.kernels.cpu_extensions` (`... <name>` builds one), which builds
them side by side, so replicas only load the library (a process that finds it built loads it without running
the build tool: replica start-up). Builders serialize on an flock, which dies with its holder: a
process killed mid-build leaves no lock that the next one waits on, and a waiting or compiling replica says so
in its log.

A kernel can also be built for an instruction set below the host's (`ISA_VARIANTS`: -march x86-64-v4, v3 or the
baseline in place of native), its ops named with the variant's suffix beside the native build's, so that tests run
each of its code paths this host can run (kernels/quantized_linear.py).
"""

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from kvloom.kernels.host_isa import HostISA, host_isa

logger = logging.getLogger(__name__)
# -fopenmp: ATen's parallel_for is an inline `omp parallel`; compiled without it, every kernel runs on one thread
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++20", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
SOURCES = {"kvloom_cpu_decode": "cpu_decode.cpp", "kvloom_cpu_prefill": "cpu_prefill.cpp",
           "kvloom_cpu_fused": "cpu_fused.cpp", "kvloom_cpu_gemm": "cpu_gemm.cpp", "kvloom_cpu_pool": "cpu_pool.cpp",
           "kvloom_cpu_lora": "cpu_lora.cpp", "kvloom_cpu_quant": "cpu_quant_gemm.cpp",
           "kvloom_cpu_stack": "cpu_decode_stack.cpp"}
HERE = Path(__file__).parent
X86_64_V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
# an x86-64 build below native: variant -> (its -march, the CPU flags it needs)
ISA_VARIANTS = {
    "avx512": ("x86-64-v4", X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "avx2": ("x86-64-v3", X86_64_V3),
    "generic": ("x86-64", frozenset()),
}


def isa_variants(isa: HostISA) -> list[str]:
    """The variant builds this CPU runs (none off x86-64, where only the native build is made)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return [variant for variant, (_, needs) in ISA_VARIANTS.items() if needs <= isa.flags]


def build_flags(variant: str | None) -> list[str]:
    """The compiler flags of a build: native, or a variant's -march with its ops' suffix (`_<variant>`)."""
    if variant is None:
        return CFLAGS
    march = f"-march={ISA_VARIANTS[variant][0]}"
    return [march if flag == "-march=native" else flag for flag in CFLAGS] + [f"-DKVLOOM_VARIANT=_{variant}"]


def _content_key(source: Path, cflags: list[str]) -> str:
    """The source's and the shared headers' content (torch's loader would not notice a header change), and the
    flags they are built with."""
    files = [source, *sorted(HERE.glob("*.h"))]
    flags = " ".join(cflags + LDFLAGS).encode()
    return hashlib.sha1(b"".join(path.read_bytes() for path in files) + flags).hexdigest()[:10]


def library_name(name: str, variant: str | None = None) -> str:
    return name if variant is None else f"{name}_{variant}"


def build_dir_for(name: str, variant: str | None = None) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    source = HERE / SOURCES[name]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())  # torch's own override
    key = _content_key(source, build_flags(variant))
    return root / f"{python}-torch{torch.__version__}-{host_isa().build_key}" / f"{library_name(name, variant)}-{key}"


@functools.cache
def build_extension(name: str, variant: str | None = None):
    """`torch.ops.kvloom` once `name` is loaded (built for this CPU, or for `variant` of ISA_VARIANTS), or None
    (with a warning) where it cannot be built: callers stay correct, just slower."""
    from torch.utils.cpp_extension import load

    build_dir = build_dir_for(name, variant)
    library = build_dir / f"{library_name(name, variant)}.so"
    if library.exists():  # built from these very sources and flags: load it, no ninja run (~1 s a kernel)
        try:
            torch.ops.load_library(str(library))
            return torch.ops.kvloom
        except OSError as exc:  # a build killed while linking: build it again below
            logger.warning("cannot load the CPU kernel %s (%s); building it again", name, exc)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with (build_dir / "kvloom.lock").open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning("waiting for another process building the CPU kernel %s in %s", name, build_dir)
                fcntl.flock(lock, fcntl.LOCK_EX)
            # we hold the only build lock: a torch lock file left here is a killed builder's
            (build_dir / "lock").unlink(missing_ok=True)
            if not library.exists():
                logger.warning("compiling the CPU kernel %s (once per machine and source; seconds)",
                               library_name(name, variant))
            for path in [HERE / SOURCES[name], *HERE.glob("*.h")]:
                if not (build_dir / path.name).exists():
                    shutil.copyfile(path, build_dir / path.name)
            # copies: torch's loader appends its libraries to the lists it is given, which would change every
            # later build's content key in this process (a fresh build folder each time)
            load(library_name(name, variant), [str(build_dir / SOURCES[name])], extra_cflags=list(build_flags(variant)),
                 extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), extra_include_paths=[str(build_dir)],
                 is_python_module=False)
    except Exception as exc:  # no compiler, no ninja, ...
        logger.warning("kvloom CPU kernel %s unavailable (%s); using the torch fallback", name, exc)
        return None
    return torch.ops.kvloom


def build_side_by_side(names: list[str]) -> None:
    """Builds each kernel in a process of its own, as many at once as the machine has cores: each is one
    translation unit, which compiles on one core, and one process can load each ops library only once."""
    from concurrent.futures import ThreadPoolExecutor

    def build(name: str) -> None:
        subprocess.run([sys.executable, "-m", "kvloom.kernels.cpu_extensions", name], check=False)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as builders:
        list(builders.map(build, names))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if len(sys.argv) == 2:
        print(sys.argv[1], "ready" if build_extension(sys.argv[1]) is not None else "unavailable (torch fallback)")
    else:
        build_side_by_side(list(SOURCES))
