"""The int8 KV cache (kv_cache_dtype="int8"): what it holds and how to read it back.

Each token's head vector of D values is stored as D int8 values followed by the fp32
scale they were divided by, 4 bytes: a cache tensor [num_blocks, block_size, kv_heads, D +
4] of int8. The scale is max |x| / 127 over the vector (0 for a vector of zeros), each
value x / scale rounded to nearest even. This is llama.cpp's q8_0 rule with one scale per
head vector instead of per 32 values; it reads and holds 0.52x a bf16 cache's bytes at D =
128 (0.53x at D = 64). vLLM's CPU backend offers fp8 (e5m2) instead, whose 2 mantissa bits
round each value by up to 12.5%; here the rounding is at most max |x| / 254 a value.

The C++ kernels (csrc/paged_attention.cpp: store_kv, paged_attention; csrc/decode_stack.cpp
for a cascade's prefix) follow the same rule; this module is the torch path's and the
tests' reference.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # the fp32 scale after each vector's values


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dimension of a cache's vectors (its last dimension less an int8 scale)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Vectors x [..., D] (float32 or bfloat16) as an int8 cache holds them: [..., D + 4]."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    values = xf / torch.where(scale > 0, scale, 1.0)  # (a vector of zeros: all 0)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8)
    out[..., :x.shape[-1]] = values.round().clamp(-127, 127).to(torch.int8)
    out[..., x.shape[-1]:] = scale.view(torch.int8)
    return out


def scales(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of an int8 cache's vectors [..., 1]."""
    return cache[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Vectors [..., D + 4] of an int8 cache as dtype [..., D]: each value times its
    vector's scale in fp32, then rounded to dtype. Other caches: converted to dtype."""
    if not is_quantized(cache):
        return cache.to(dtype)
    return (cache[..., :-SCALE_BYTES].float() * scales(cache)).to(dtype)
