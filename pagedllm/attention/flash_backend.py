"""Paged attention through flash-attn (CUDA only, fp16 / bf16), as nano-vllm does (seed 002).

Prefill: flash_attn_varlen_func over the packed new tokens, or, when a prefix is cached,
over the paged cache itself (block_table). Decode: flash_attn_with_kvcache with the
block tables and context lengths. flash-attn's paged KV needs blocks of a multiple of 256
tokens and fp16 / bf16 (attention/dispatch.py checks both). K/V are stored by the Triton slot-mapping kernel (it skips -1 slots, which padded
CUDA-graph rows use).
"""
from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from pagedllm.attention.context import Context
from pagedllm.attention.triton_backend import store_kvcache


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
    if k_cache.numel():
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    if ctx.is_prefill:
        assert ctx.cu_seqlens_q is not None and ctx.cu_seqlens_k is not None
        block_table = None
        if ctx.block_tables is not None:  # a cached prefix: attend over the paged cache
            k, v, block_table = k_cache, v_cache, ctx.block_tables.int()
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=ctx.cu_seqlens_q.int(), cu_seqlens_k=ctx.cu_seqlens_k.int(),
            max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=block_table)
    assert ctx.block_tables is not None and ctx.context_lens is not None
    o = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                cache_seqlens=ctx.context_lens.int(),
                                block_table=ctx.block_tables.int(), softmax_scale=scale,
                                causal=True)
    return o.squeeze(1)
