"""Rotary position embedding, half-rotation layout (rotate_half), with a cos/sin cache.

Scalings: "linear" (positions divided by a factor), "llama3" (long wavelengths stretched),
"longrope" (Phi-3: per-frequency short or long factors, the long ones where a sequence has
grown past the original context, as HF switches them per forward pass). A rotary_dim below
head_dim rotates only each head's first rotary_dim dims (partial rotary).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.context import get_context
from pagedllm.kernels import ops
from pagedllm.layers.custom_op import uses_cpu_kernels, uses_cuda_kernels


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.x frequency scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band between is interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _cos_sin_caches(inv_freq: torch.Tensor, max_position: int, scale: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = t[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def _longrope(head_dim: int, base: float, max_position: int, scaling: dict[str, Any]
              ) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(short inv_freq, long inv_freq, cos/sin scale, original context) of LongRoPE."""
    original = int(scaling["original_max_position_embeddings"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * base ** exponents)
                   for k in ("short_factor", "long_factor"))
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return short, long, float(attention_factor), original


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim = rotary_dim or head_dim
        self.partial = rotary_dim != head_dim
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        self.long_after: int | None = None  # LongRoPE: the original context
        inv_freq = _inv_freq(rotary_dim, base)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
        elif rope_type == "linear":
            inv_freq = inv_freq / float(rope_scaling["factor"])  # type: ignore[index]
        elif rope_type == "longrope":
            inv_freq, long_inv_freq, scale, self.long_after = _longrope(
                rotary_dim, base, max_position, rope_scaling)  # type: ignore[arg-type]
            long_cos, long_sin = _cos_sin_caches(long_inv_freq, max_position, scale)
            self.register_buffer("long_cos_cache", long_cos, persistent=False)
            self.register_buffer("long_sin_cache", long_sin, persistent=False)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                             f"(supported: default, linear, llama3, longrope)")
        cos, sin = _cos_sin_caches(inv_freq, max_position,
                                   scale if rope_type == "longrope" else 1.0)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # chosen once: an instance attribute, no per-call check
        if self.plain and uses_cpu_kernels():
            self.rotate = self.rotate_cpu
        elif self.plain and uses_cuda_kernels():
            self.rotate = self.rotate_cuda
        else:
            self.rotate = self.rotate_native

    @property
    def plain(self) -> bool:
        """Every head dim rotated by one cos/sin cache (what the C++ kernels take)."""
        return not self.partial and self.long_after is None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of the positions; every layer of a step passes the same
        positions tensor, so they are looked up once per step, not once per layer. The
        lookup is kept in the step's Context (a new one each step, and for each CUDA-graph
        capture), never across steps: a graph must capture the lookup itself, not a tensor
        an earlier step left."""
        plans = get_context().backend_plans
        key = ("rotary", id(self), dtype)
        memo = plans.get(key)
        if memo is None or memo[0] is not positions:
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]
            if self.long_after is not None:
                long = (_row_lengths(positions) > self.long_after)[:, None]
                cos = torch.where(long, self.long_cos_cache[positions], cos)
                sin = torch.where(long, self.long_sin_cache[positions], sin)
            memo = plans[key] = (positions, cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))
        return memo[1], memo[2]

    def rotate_native(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by its positions [T] (q and k heads may come together)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if self.partial:
            rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
            return torch.cat((rot * cos + rotate_half(rot) * sin, rest), -1)
        return x * cos + rotate_half(x) * sin

    def rotate_cpu(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The same by the C++ kernel, in place (x is a view of this step's qkv output)."""
        if x.stride(-1) != 1:
            return self.rotate_native(positions, x)
        ops.rotary_embedding(positions, x, self.cos_cache, self.sin_cache)
        return x

    def rotate_cuda(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The same by one Triton kernel, in place, for 16-bit x (layers/triton_ops.py)."""
        from pagedllm.layers import triton_ops
        if not triton_ops.takes(x):
            return self.rotate_native(positions, x)
        return triton_ops.rotary_(positions, x, self.cos_cache, self.sin_cache)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] rotated by their positions [T]."""
        return self.rotate(positions, q), self.rotate(positions, k)


def _row_lengths(positions: torch.Tensor) -> torch.Tensor:
    """Each token's sequence length in this step (its row's cached + new tokens), from the
    step's attention context; without one (a plain forward), the batch's longest."""
    ctx = get_context()
    if ctx.seqlens_q is not None and ctx.seqlens_k is not None:
        lens = torch.tensor(ctx.seqlens_k).repeat_interleave(torch.tensor(ctx.seqlens_q))
        return lens.to(positions.device, non_blocking=True)
    if ctx.context_lens is not None and len(ctx.context_lens) == len(positions):
        return ctx.context_lens
    return (positions.max() + 1).expand(len(positions))
