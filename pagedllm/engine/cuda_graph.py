"""Decode steps replayed from CUDA graphs, one per batch size (as nano-vllm, seed 002).

A decode step launches hundreds of small kernels; replaying a captured graph removes the
per-launch CPU cost. Graphs are captured for batch sizes 1, 2, 4, 8, 16, 32, ... up to
max_num_seqs (at most 512), largest first so that the smaller ones reuse its memory pool.
A batch runs in the smallest graph that fits it: its rows are copied into static buffers,
the padding rows get slot -1 (their K/V is not stored) and context length 0.

The attention backend must accept that padding (the Triton store skips slot -1, the
Triton decode kernel writes zeros for a length-0 row) and must not synchronise with the
host during decode; a model whose layers do (graph_blocker) runs its decode steps eagerly.
Every per-step tensor a layer derives is computed inside the captured forward (rotary
tables per Context, see layers/rotary.py), so a replay recomputes it from the buffers.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.attention.context import Context, reset_context, set_context

logger = logging.getLogger(__name__)


def graph_blocker(model: nn.Module) -> str | None:
    """Why the model's decode step cannot be captured (None when it can): its mixture-of-
    experts layers size each expert's rows on the host (a sync a graph cannot hold)."""
    from pagedllm.layers.moe import FusedMoE
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return "its mixture-of-experts layers group rows by expert on the host"
    return None


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    limit = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b <= limit] + list(range(16, limit + 1, 16))
    if sizes[-1] < limit:
        sizes.append(limit)
    return sizes


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        n = self.max_batch_size = self.batch_sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.context_lens = torch.zeros(n, **i64)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i64)
        self.outputs = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            self._set_context(bs)
            self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs])  # warm up
            # A fresh Context: nothing the warm-up worked out (the rotary lookup, backend
            # plans) may be baked into the graph; the capture computes its own.
            self._set_context(bs)
            with torch.cuda.graph(graph, pool):
                self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs])
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize(device)
            reset_context()

    def _set_context(self, bs: int) -> None:
        set_context(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                    context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Hidden states of a decode batch of n <= max_batch_size rows."""
        assert ctx.block_tables is not None and ctx.context_lens is not None
        assert ctx.slot_mapping is not None
        n = input_ids.numel()
        bs = next(b for b in self.batch_sizes if b >= n)
        width = ctx.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n] = ctx.slot_mapping
        self.context_lens.zero_()
        self.context_lens[:n] = ctx.context_lens
        self.block_tables[:n, :width] = ctx.block_tables
        self.graphs[bs].replay()
        return self.outputs[:n]
