"""Compute dtype by hardware: CPU flags read from /proc/cpuinfo text, `auto` resolved from them."""

import torch

from app.model.hardware import cpu_flags, has_fast_bf16, resolve_dtype

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_bf16_units_are_found_in_the_cpu_flags():
    assert "avx2" in cpu_flags(AVX2_ONLY)
    cpu = torch.device("cpu")
    assert not has_fast_bf16(cpu, AVX2_ONLY)
    assert has_fast_bf16(cpu, SAPPHIRE_RAPIDS) and has_fast_bf16(cpu, GRAVITON3)


def test_auto_becomes_bf16_only_where_it_is_fast_and_explicit_dtypes_stay():
    assert resolve_dtype("auto", fast_bf16=True) == "bfloat16"
    assert resolve_dtype("auto", fast_bf16=False) == "float32"
    assert resolve_dtype("float32", fast_bf16=True) == "float32"
