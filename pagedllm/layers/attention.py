"""The Attention layer: stores the new K/V into the paged cache and attends through it.

The kernels come from a backend (attention/, chosen by attention/dispatch.py); the
ModelRunner binds `impl` to the backend's attention function, and k_cache and v_cache to
views into the engine's single KV tensor after it allocates the cache.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import torch_native
from pagedllm.attention.context import get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.impl = torch_native.attention  # the backend, bound by the ModelRunner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        o = self.impl(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale)
        return o.flatten(-2)
