"""What the CPU itself says it has (/proc/cpuinfo), independent of what the build or torch
report: kernel tests skip only where the CPU lacks an instruction set, and fail where it has
one and the kernel is missing."""
from __future__ import annotations


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def cpu_has_amx_bf16() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


def cpu_has_amx_int8() -> bool:
    """What the GGUF kernel's AMX path takes (its few rows: AVX512-VNNI)."""
    return {"amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni"} <= cpu_flags()
