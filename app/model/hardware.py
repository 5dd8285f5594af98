"""Which compute dtype is fastest where a worker runs: detected, never assumed from one machine.

bf16 pays off on GPUs and on CPUs with bf16 matrix units (AVX-512 BF16, AMX; ARMv8.6 BF16). On a CPU
without them (AVX2 only) every bf16 matmul is emulated, and fp32 ran twice as fast on the embedded
model (docs/performance.md). `auto` in model.dtype and fsdp.param_dtype resolves to the result.
"""

from __future__ import annotations

from pathlib import Path

import torch

CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" in an aarch64 Features line


def torch_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """A config dtype name as a torch dtype; `auto` resolved for the hardware of `device`. (A run's workers
    decide `auto` once, all ranks agreeing, before they build anything: app/train/measured.py.)"""
    device = torch.device(device)
    return getattr(torch, resolve_dtype(name, has_fast_bf16(device) if name == "auto" else False))


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of this machine's CPU, from /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def has_fast_bf16(device: torch.device, cpuinfo: str | None = None) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(CPU_BF16_FLAGS & cpu_flags(cpuinfo))


def resolve_dtype(name: str, fast_bf16: bool) -> str:
    """`auto` -> bfloat16 where the hardware computes it natively, float32 elsewhere; others unchanged."""
    if name != "auto":
        return name
    return "bfloat16" if fast_bf16 else "float32"

