"""The Attention layer: stores the new K/V into the paged cache and attends through it.

The kernels come from a backend (attention/, chosen by attention/dispatch.py); the
ModelRunner binds the layer to the backend (bind_backend), and k_cache and v_cache to
views into the engine's single KV tensor after it allocates the cache. A layer may have a
window and a soft-cap on its scores (see torch_native); the backend must list them in its
FEATURES.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from pagedllm.attention import torch_native
from pagedllm.attention.context import get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.k_cache = self.v_cache = torch.tensor([])
        self.bind_backend(torch_native)

    def bind_backend(self, backend: ModuleType) -> None:
        """Attend through backend.attention from now on."""
        options = {"window": self.sliding_window, "softcap": self.logit_softcap}
        needs = {"sliding_window"} if self.sliding_window is not None else set()
        needs |= {"logit_softcap"} if self.logit_softcap is not None else set()
        lacking = needs - getattr(backend, "FEATURES", frozenset())
        if lacking:
            raise ValueError(f"attention backend {backend.__name__.rpartition('.')[2]!r} does not "
                             f"support {' or '.join(sorted(lacking))}, which this model's layers "
                             f"use; choose attention_backend='torch' or 'cpu_paged'")
        self.impl = functools.partial(backend.attention, **options) if needs else backend.attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        o = self.impl(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale)
        return o.flatten(-2)
