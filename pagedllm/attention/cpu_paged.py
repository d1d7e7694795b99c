"""CPU paged attention with a C++ kernel that reads the KV blocks in place.

torch_native's decode gathers every sequence's whole padded context out of the cache in
every layer of every step (a full copy of the live KV cache per step); this kernel walks
the block tables instead. It is part of the C++ extension pagedllm.cpu_ops builds on first
use; if that fails the engine falls back to torch_native, which stays the reference.

Per row of the batch (num cached tokens, num new tokens): rows with few new tokens
(decodes, short chunks over a cached prefix) take the kernel; a prompt with nothing cached
takes torch's flash attention over its own new tokens; a long chunk over a cached prefix
gathers its context once and takes torch's SDPA (the gather is amortised over the chunk).
"""
from __future__ import annotations

import functools

import torch

from pagedllm import cpu_ops
from pagedllm.attention import torch_native
from pagedllm.attention.context import Context

# Rows with at most this many new tokens over a cached prefix run in the kernel.
MAX_KERNEL_QUERY_LEN = 32


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                    q_lens: torch.Tensor, k_lens: torch.Tensor, scale: float) -> None:
    """Write into out the causal attention of rows' new tokens over their paged K/V.

    Row i's q_lens[i] tokens sit at q[q_starts[i]:] and follow k_lens[i] - q_lens[i] cached
    tokens; all k_lens[i] K/V vectors (the new ones too) are already in the cache.
    """
    ext = cpu_ops.load()
    assert ext is not None, "the C++ paged-attention kernel is not available"
    ext.paged_attention(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     ctx: Context, scale: float) -> torch.Tensor:
    """One new token per row (the first len(q) rows of the context)."""
    assert ctx.block_tables is not None and ctx.context_lens is not None
    n = q.shape[0]
    out = torch.empty_like(q)
    q_starts, ones = _decode_rows(n)
    paged_attention(out, q, k_cache, v_cache, ctx.block_tables[:n], q_starts, ones,
                    ctx.context_lens[:n], scale)
    return out


@functools.lru_cache(maxsize=64)
def _decode_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_starts (0..n-1) and q_lens (all 1) of n decode rows: built once per batch size, not
    in each layer of each step (the kernel only reads them)."""
    return torch.arange(n), torch.ones(n, dtype=torch.int64)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, ctx: Context, scale: float,
                      first_row: int = 0) -> torch.Tensor:
    """Rows first_row.. of the context, their new tokens packed in q, k, v."""
    assert ctx.seqlens_q is not None and ctx.seqlens_k is not None
    out = torch.empty_like(q)
    kernel_rows: list[tuple[int, int, int, int]] = []   # (row, q_start, q_len, k_len)
    start = 0
    for i in range(first_row, len(ctx.seqlens_q)):
        len_q, len_k = ctx.seqlens_q[i], ctx.seqlens_k[i]
        end = start + len_q
        if len_k == len_q:
            out[start:end] = torch_native._sdpa(q[start:end], k[start:end], v[start:end], scale,
                                                causal=True)
        elif len_q <= MAX_KERNEL_QUERY_LEN:
            kernel_rows.append((i, start, len_q, len_k))
        else:
            assert ctx.block_tables is not None
            out[start:end] = torch_native.cached_prefix_attention(
                q[start:end], k_cache, v_cache, ctx.block_tables[i], len_k, scale)
        start = end
    if kernel_rows:
        assert ctx.block_tables is not None
        rows, q_starts, q_lens, k_lens = (torch.tensor(c, dtype=torch.int64)
                                          for c in zip(*kernel_rows))
        paged_attention(out, q, k_cache, v_cache, ctx.block_tables[rows].contiguous(), q_starts,
                        q_lens, k_lens, scale)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
    """Same contract as torch_native.attention."""
    if not k_cache.numel():  # no cache bound (profiling runs): nothing to read in place
        return torch_native.attention(q, k, v, k_cache, v_cache, ctx, scale)
    cpu_ops.load().store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    q = q.contiguous()
    if not ctx.is_prefill:
        return decode_attention(q, k_cache, v_cache, ctx, scale)
    num_decodes = ctx.num_decodes  # a mixed batch (chunked prefill): decode rows come first
    if num_decodes == 0:
        return prefill_attention(q, k, v, k_cache, v_cache, ctx, scale)
    return torch.cat([decode_attention(q[:num_decodes], k_cache, v_cache, ctx, scale),
                      prefill_attention(q[num_decodes:], k[num_decodes:], v[num_decodes:],
                                        k_cache, v_cache, ctx, scale, first_row=num_decodes)])
