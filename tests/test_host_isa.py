"""dtype `auto` follows the CPU: bfloat16 where the hardware multiplies it (AMX, AVX512-BF16) or kvloom's GEMM
widens it in registers (any AVX-512), float32 elsewhere; the detection is fed fake /proc/cpuinfo texts."""

import logging

import pytest
import torch

from kvloom.engine.resources import resolve_dtype
from kvloom.kernels.host_isa import HostISA, auto_cpu_dtype

XEON_AMX = "fpu sse2 avx avx2 avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8"
XEON_AVX512_BF16 = "fpu sse2 avx avx2 avx512f avx512bw avx512vl avx512_bf16"
XEON_AVX512_NO_BF16 = "fpu sse2 avx avx2 avx512f avx512bw avx512vl avx512_vnni"
EPYC_ZEN3 = "fpu sse2 avx avx2 fma f16c"
GRAVITON = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve"


def cpuinfo(flags: str, model: str = "Some CPU", key: str = "flags") -> str:
    core = f"processor\t: {{}}\nmodel name\t: {model}\n{key}\t\t: {flags}\n"
    return "\n".join(core.format(i) for i in range(2))


@pytest.mark.parametrize("flags, expected", [
    (XEON_AMX, "bfloat16"), (XEON_AVX512_BF16, "bfloat16"), (XEON_AVX512_NO_BF16, "bfloat16"),
    (EPYC_ZEN3, "float32"), (GRAVITON, "float32"), ("", "float32"),
])
def test_auto_picks_bfloat16_where_the_cpu_multiplies_it_or_an_avx512_kernel_widens_it(flags, expected):
    assert auto_cpu_dtype(HostISA.parse(cpuinfo(flags))) == expected


def test_amx_needs_its_tile_unit_too():
    assert not HostISA.parse(cpuinfo("avx2 amx_bf16")).fast_bfloat16


def test_arm_features_line_and_model_name_are_read():
    isa = HostISA.parse(cpuinfo(GRAVITON, key="Features"))
    assert "sve" in isa.flags and isa.describe().startswith("Some CPU [")


def test_description_names_the_cpu_and_the_flags_that_decide():
    text = HostISA.parse(cpuinfo(XEON_AMX, model="Intel(R) Xeon(R) Processor")).describe()
    assert text == "Intel(R) Xeon(R) Processor [avx2 avx512f avx512_bf16 amx_bf16 amx_tile]"


def test_build_cache_key_differs_between_instruction_sets():
    keys = {HostISA.parse(cpuinfo(flags)).build_key for flags in (XEON_AMX, XEON_AVX512_NO_BF16, EPYC_ZEN3)}
    assert len(keys) == 3


def test_report_key_names_the_cpu_and_its_fastest_matrix_unit():
    assert HostISA.parse(cpuinfo(XEON_AMX, model="Intel(R) Xeon(R) Processor")).report_key == "intel-xeon-amx"
    assert HostISA.parse(cpuinfo(XEON_AVX512_BF16, model="AMD EPYC 9R14")).report_key == "amd-epyc-avx512bf16"
    assert HostISA.parse(cpuinfo(XEON_AVX512_NO_BF16, model="Intel(R) Xeon(R) Processor")).report_key == \
        "intel-xeon-avx512"
    assert HostISA.parse(cpuinfo(EPYC_ZEN3, model="AMD EPYC")).report_key == "amd-epyc-avx2"
    assert HostISA.parse(cpuinfo("", model="Some CPU")).report_key == "some-cpu-generic"


def test_engine_dtype_auto_asks_the_detection_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="kvloom.engine.resources")
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, HostISA.parse(cpuinfo(XEON_AMX))) == torch.bfloat16
    assert "bfloat16 in hardware" in caplog.text
    assert resolve_dtype("auto", cpu, HostISA.parse(cpuinfo(XEON_AVX512_NO_BF16))) == torch.bfloat16
    assert "bfloat16 weights widened in registers" in caplog.text
    assert resolve_dtype("auto", cpu, HostISA.parse(cpuinfo(EPYC_ZEN3))) == torch.float32
    assert "no bfloat16 units" in caplog.text


def test_an_explicit_dtype_is_kept_whatever_the_cpu():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu, HostISA.parse(cpuinfo(XEON_AMX))) == torch.float32
    assert resolve_dtype("bfloat16", cpu, HostISA.parse(cpuinfo(EPYC_ZEN3))) == torch.bfloat16
