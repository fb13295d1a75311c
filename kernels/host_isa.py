"""What this CPU can do, read once from its flags: the one place dtype `auto`, kernel choice, build
caches and reports ask.

These hosts change between sessions (an AMD EPYC with AVX2 only one day, an Intel Xeon with AVX512-BF16
and AMX tiles the next, a Xeon with AVX-512 and no bfloat16 units the day after), so nothing is assumed:
oneDNN multiplies bfloat16 natively only with AMX tiles or AVX512-BF16 dot products, and emulates it
(slower than float32) elsewhere; kvloom's own GEMM also runs bfloat16 weights fast on any AVX-512 CPU.
"""

import functools
import hashlib
import platform
import re
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


@dataclass(frozen=True)
class HostISA:
    model_name: str
    flags: frozenset[str]

    @classmethod
    def parse(cls, cpuinfo: str) -> "HostISA":
        """From /proc/cpuinfo's text (x86 `flags`, Arm `Features`)."""
        fields: dict[str, str] = {}
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first core's
        model = fields.get("model name") or platform.processor() or platform.machine()
        return cls(model, frozenset((fields.get("flags") or fields.get("Features") or "").split()))

    @property
    def amx_bf16(self) -> bool:
        return "amx_bf16" in self.flags and "amx_tile" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def avx512(self) -> bool:
        """512-bit vectors (AVX-512 Foundation): kvloom's blocked GEMM builds here."""
        return "avx512f" in self.flags

    @property
    def fast_bfloat16(self) -> bool:
        """bfloat16 matrix math in hardware (AMX tiles or AVX512-BF16), so halving the weight bytes pays."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def build_key(self) -> str:
        """A short key for this instruction set: `-march=native` binaries built on an AVX-512 host die
        with SIGILL on an AVX2 one, and a home directory (hence a build cache) may be shared."""
        digest = hashlib.sha1(" ".join(sorted(self.flags)).encode()).hexdigest()[:8]
        return f"{platform.machine()}-{digest}"

    @property
    def report_key(self) -> str:
        """A readable name for this kind of host, for benchmark results kept side by side per host:
        the model's first two words and its fastest matrix unit (`intel-xeon-amx`, `amd-epyc-avx512bf16`)."""
        words = re.sub(r"\((R|TM)\)", "", self.model_name).lower().split()[:2]
        unit = next((tag for tag, present in (
            ("amx", self.amx_bf16), ("avx512bf16", self.avx512_bf16), ("avx512", self.avx512),
            ("avx2", "avx2" in self.flags), ("sve", "sve" in self.flags), ("neon", "asimd" in self.flags),
        ) if present), "generic")
        return "-".join([*(re.sub(r"[^a-z0-9]", "", w) for w in words), unit])

    def describe(self) -> str:
        """One line for logs and reports: the CPU and the flags that decide kvloom's fast paths."""
        shown = [f for f in SHOWN_FLAGS if f in self.flags]
        return f"{self.model_name} [{' '.join(shown) or 'no SIMD flags of note'}]"


@functools.cache
def host_isa() -> HostISA:
    try:
        return HostISA.parse(CPUINFO.read_text())
    except OSError:
        return HostISA(platform.processor() or platform.machine(), frozenset())


def auto_cpu_dtype(isa: HostISA) -> str:
    """dtype `auto` on a CPU: bfloat16 where it is the faster dtype, float32 elsewhere. That is where the
    hardware multiplies it, and on any AVX-512 CPU: kvloom's blocked GEMM widens bfloat16 weights to float32 in
    registers there, so they stream at half the bytes for float32's math (measured: docs/performance.md)."""
    return "bfloat16" if isa.fast_bfloat16 or isa.avx512 else "float32"
