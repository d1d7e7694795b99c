"""Rotary position embedding, half-rotation layout (rotate_half), with a cos/sin cache."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import ops
from pagedllm.layers.custom_op import uses_cpu_kernels


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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base)
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # chosen once: an instance attribute, no per-call check
        self.rotate = self.rotate_cpu if uses_cpu_kernels() else self.rotate_native

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of the positions; every layer of a step passes the same
        positions tensor, so they are looked up once per step, not once per layer."""
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != dtype:
            cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
            sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
            memo = self._memo = (positions, dtype, cos, sin)
        return memo[2], memo[3]

    def rotate_native(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by its positions [T] (q and k heads may come together)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return x * cos + rotate_half(x) * sin

    def rotate_cpu(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The same by the C++ kernel, in place (x is a view of this step's qkv output)."""
        if x.stride(-1) != 1:
            return self.rotate_native(positions, x)
        ops.rotary_embedding(positions, x, self.cos_cache, self.sin_cache)
        return x

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] rotated by their positions [T]."""
        return self.rotate(positions, q), self.rotate(positions, k)
