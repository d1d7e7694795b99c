"""Choose the attention backend: a module exposing attention(q, k, v, k_cache, v_cache, ctx,
scale) with torch_native's shapes and meaning.

Backends are imported by name only when chosen, so the CPU path never imports triton or
flash-attn. "auto" is the C++ paged-attention kernel (cpu_paged) on CPU, or torch_native
when that kernel cannot be built; on CUDA flash-attn when it is installed and the settings
suit it (blocks of 256n tokens, fp16/bf16), else Triton.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from pagedllm.kernels import probes

BACKEND_MODULES = {
    "torch": "pagedllm.attention.torch_native",
    "cpu_paged": "pagedllm.attention.cpu_paged",
    "triton": "pagedllm.attention.triton_backend",
    "flash": "pagedllm.attention.flash_backend",
}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def backend_problems(name: str, device: str, block_size: int, dtype: torch.dtype) -> list[str]:
    """Why backend `name` cannot run these settings (empty when it can)."""
    problems = []
    if name == "torch" and device == "cuda":
        problems.append("the torch backend is CPU-only (it builds its masks on the host); "
                        "use triton or flash on CUDA")
    if name == "cpu_paged":
        if device != "cpu":
            problems.append("the cpu_paged kernel is CPU-only; use triton or flash on CUDA")
        elif not probes.available():
            problems.append(f"the C++ kernel did not build ({probes.unavailable_reason()})")
    if name == "flash":
        if device != "cuda":
            problems.append("flash-attn needs device='cuda' (it has no CPU kernels)")
        if not _importable("flash_attn"):
            problems.append("the flash_attn package is not installed (pip install flash-attn)")
        if block_size % 256:
            problems.append(f"flash-attn's paged KV cache needs block_size a multiple of 256, "
                            f"got {block_size}")
        if dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"flash-attn runs float16 / bfloat16 only, got {dtype}")
    elif name == "triton":
        if not _importable("triton"):
            problems.append("triton is not installed")
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            problems.append("triton on CPU needs TRITON_INTERPRET=1 (the interpreter; slow, "
                            "for testing only)")
        if block_size < 16 or block_size & (block_size - 1):
            problems.append(f"the triton kernels need a power-of-two block_size >= 16, "
                            f"got {block_size}")
    return problems


def resolve_backend(name: str, device: str, block_size: int, dtype: torch.dtype) -> str:
    """The concrete backend for a config value; raises ValueError naming what is missing."""
    if name == "auto":
        if device != "cuda":
            cpu_paged_fails = backend_problems("cpu_paged", device, block_size, dtype)
            return "torch" if cpu_paged_fails else "cpu_paged"
        for candidate in ("flash", "triton"):
            if not backend_problems(candidate, device, block_size, dtype):
                return candidate
        name = "triton"  # report why the fallback cannot run either
    problems = backend_problems(name, device, block_size, dtype)
    if problems:
        raise ValueError(f"attention_backend={name!r} cannot run here: " + "; ".join(problems))
    return name


def load_backend(name: str) -> ModuleType:
    """The backend module for a resolved name (imports triton / flash-attn only here)."""
    return importlib.import_module(BACKEND_MODULES[name])
