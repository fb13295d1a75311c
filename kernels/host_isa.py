"""What this CPU can do, read once from its flags: the one place dtype `auto`, kernel choice, build
caches and reports ask.

These hosts change between sessions (an AMD EPYC with AVX-512 and no bfloat16 units one day, an Intel
Xeon with AVX512-BF16 and AMX tiles the next), so nothing is assumed: bfloat16 is the fast dtype only
where the silicon multiplies it natively (AMX tiles or AVX512-BF16 dot products; oneDNN uses both). On
a CPU without either, bfloat16 GEMMs are emulated and slower than float32.
"""

import functools
import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")


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
    def fast_bfloat16(self) -> bool:
        """bfloat16 matrix math in hardware (AMX tiles or AVX512-BF16), so halving the weight bytes pays."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def build_key(self) -> str:
        """A short key for this instruction set: `-march=native` binaries built on an AVX-512 host die
        with SIGILL on an AVX2 one, and a home directory (hence a build cache) may be shared."""
        digest = hashlib.sha1(" ".join(sorted(self.flags)).encode()).hexdigest()[:8]
        return f"{platform.machine()}-{digest}"

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
    """dtype `auto` on a CPU: bfloat16 where the hardware multiplies it, float32 elsewhere."""
    return "bfloat16" if isa.fast_bfloat16 else "float32"
