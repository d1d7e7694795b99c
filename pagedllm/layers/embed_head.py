"""Vocabulary-parallel embedding and LM head (rank r holds a slice of the vocabulary)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import all_reduce, get_tp_rank, get_tp_size
from pagedllm.layers.linear import LinearLayer
from pagedllm.layers.quantized import embedding_rows


class VocabParallelEmbedding(nn.Module):
    """tied_rows: set by the loader where this embedding shares its weight with a linear
    layer (a tied LM head), whose method holds the weight (packed, maybe only so): that
    layer's LinearLayer.embedding_rows. gguf_parts: a GGUF embedding kept quantized
    (layers/quantized.py), in place of the weight."""

    gguf_parts: list | None = None
    tied_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        part = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tied_rows is None:
            return F.embedding(ids, self.weight)
        return self.tied_rows(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_parts is not None:
            return embedding_rows(self, input_ids, self.weight.dtype)
        if self.tp_size == 1:
            return self.rows(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = self.rows(local.clamp(0, self.shard_size - 1)) * mine.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(LinearLayer, VocabParallelEmbedding):
    """Logits for the rows given; with several ranks the vocabulary slices are gathered
    on rank 0 (the others return None)."""

    fp32_out = True  # where pagedllm's bf16 kernel computes them (see PackedBf16LinearMethod)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self.linear_method.apply(self, hidden)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        if self.tp_rank != 0:
            return None
        return torch.cat(parts, -1)[:, :self.vocab_size]  # type: ignore[arg-type]
