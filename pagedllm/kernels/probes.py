"""What this CPU and this build of the kernels can run, and where each linear kernel wins.

Layers and backends ask these once, when they choose their implementation; the answers do
not change while the process runs.
"""
from __future__ import annotations

import functools

import torch

from pagedllm.kernels import build

# Row counts where one linear kernel stops beating another, measured over SmolLM2-135M's 30
# layers on the 2-core machines (Zen 5 without AMX, Xeon with AMX):
# - bf16 weights not packed for pagedllm's kernel take its weight-streaming kernel
#   (small_linear.cpp) up to this many rows, where oneDNN streams weights slowly:
#   7.9 vs 11.3 ms at 4 rows, 10.6 vs 15.9 at 8, 17.3 vs 18.7 at 16; on par at 24.
SMALL_LINEAR_MAX_ROWS = 16
# - with AMX, up to this many (4-5x torch's speed at one row, on par at 4)...
SMALL_LINEAR_MAX_ROWS_AMX = 4
# - ...and beyond that pagedllm's AMX kernel on the plain weight (amx_linear.cpp), where
#   oneDNN streams the weights at 13-16 GB/s: 9.8 vs 13.4 ms at 16 rows, 13 vs 15 at 32;
#   oneDNN is faster from ~48.
AMX_LINEAR_MAX_ROWS = 32


def available() -> bool:
    """Whether the C++ kernels are built and loaded (building them on first use)."""
    return build.load() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are not available (None when they are)."""
    return None if available() else build.load_error


@functools.cache
def has_avx512_bf16() -> bool:
    """The bf16 linear kernels (weight-streaming, packed) run: a build with
    AVX512-BF16 on a CPU that has it."""
    ext = build.load()
    return ext is not None and ext.has_small_linear_bf16()


@functools.cache
def has_packed_linear() -> bool:
    """pagedllm's packed bf16 linear is built."""
    ext = build.load()
    return ext is not None and ext.has_packed_linear_bf16()


@functools.cache
def gguf_linear_available() -> bool:
    """The GGUF linear kernel (csrc/gguf_linear.cpp) runs: built with AVX-512 or AVX2."""
    ext = build.load()
    return ext is not None and bool(ext.gguf_linear_isa())


@functools.cache
def has_amx() -> bool:
    """The AMX kernels (prompt attention, linear) run here."""
    ext = build.load()
    return ext is not None and ext.amx_available()


def prompt_attention_isa() -> str:
    """What prompt_attention and attention_over_keys run on: 'amx', 'avx512_bf16' or ''
    (not built: no AVX512-BF16)."""
    ext = build.load()
    return "" if ext is None else ext.prompt_attention_isa()


def paged_attention_scores() -> str:
    """How paged_attention scores bf16 keys: 'avx512_bf16', 'avx512' or 'scalar'."""
    ext = build.load()
    return "" if ext is None else ext.paged_attention_scores()


@functools.cache
def elementwise_isa() -> str:
    """What the fused elementwise kernels (RMSNorm, SiLU-and-mul, rotary, argmax) run on:
    'avx512', 'avx2' (with FMA and F16C) or 'scalar' ('' where the kernels are not built)."""
    ext = build.load()
    return "" if ext is None else ext.elementwise_isa()


def elementwise_vectorized() -> bool:
    """The fused elementwise kernels are vector code (AVX-512 or AVX2), rounding where
    torch's ops round. A build with neither has only their scalar loops, which sum and
    exponentiate in another order (fp32 logits of a random Llama drifted 1.7e-4 from HF's)
    and are no faster than torch's own vectorized ops; there the layers take torch's."""
    return elementwise_isa() in ("avx512", "avx2")


def cpu_has_native_bf16() -> bool:
    """The CPU itself runs bf16 matmuls natively (AVX512-BF16 or AMX), built kernels or not."""
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)()
               for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def amx_linear_rows() -> int:
    """Up to how many rows bf16 linears take the AMX kernel (0: none here)."""
    return AMX_LINEAR_MAX_ROWS if has_amx() else 0


def small_linear_rows() -> int:
    """Up to how many rows bf16 linears whose weight is not packed for pagedllm's kernel take
    the weight-streaming kernel (where has_avx512_bf16())."""
    return SMALL_LINEAR_MAX_ROWS_AMX if has_amx() else SMALL_LINEAR_MAX_ROWS
