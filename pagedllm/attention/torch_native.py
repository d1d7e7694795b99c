"""Paged attention in plain PyTorch: the portable CPU backend and the reference for others.

Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (int8 caches: head_dim + 4,
each vector's values and scale: attention/kv_quant.py).

A layer may have a window (a query at position p sees keys p - window + 1 .. p) and a
soft-cap (each score s becomes cap * tanh(s / cap) before the softmax), as Mistral's and
Gemma's layers do. Block-table entries whose blocks lie wholly before a row's window may be
-1 (freed); they are never read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention import kv_quant
from pagedllm.attention.context import Context

# What this backend's attention() takes besides the plain causal attention.
FEATURES = frozenset({"sliding_window", "logit_softcap"})


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K and V into its slot (block_id * block_size + offset)."""
    num_kv_heads, width = k_cache.shape[-2:]
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = kv_quant.quantize(new) if kv_quant.is_quantized(cache) else new.to(cache.dtype)
        cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, new)


def as_cached(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens' k and v as the cache holds them: rounded to its dtype (a bf16 cache under
    fp32 activations) and back, so that attention over them equals attention over what
    later steps read, whether the prompt was computed whole, in chunks or from a cached
    prefix. Unchanged where the cache has their dtype (or none is bound)."""
    if not cache.numel() or cache.dtype == k.dtype:
        return k, v
    if kv_quant.is_quantized(cache):
        return (kv_quant.dequantize(kv_quant.quantize(k), k.dtype),
                kv_quant.dequantize(kv_quant.quantize(v), v.dtype))
    return k.to(cache.dtype).to(k.dtype), v.to(cache.dtype).to(v.dtype)


def as_stored(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """as_cached, once the new tokens are stored in their slots: an int8 cache's copies are
    read back and dequantized rather than quantized a second time (a 2048-token prompt's K of
    8 heads of 128: 6 ms against 15-75 on two cores). Tokens not stored (slot -1), or no
    cache bound: as_cached."""
    if (k_cache.numel() and kv_quant.is_quantized(k_cache) and slot_mapping.numel()
            and int(slot_mapping.min()) >= 0):
        heads, width = k_cache.shape[-2:]
        return tuple(kv_quant.dequantize(c.view(-1, heads, width).index_select(0, slot_mapping),
                                         new.dtype) for new, c in ((k, k_cache), (v, v_cache)))
    return as_cached(k, v, k_cache)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens cached K (or V) vectors of one sequence: [num_tokens, kv_heads, dim]."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    # index_select copies whole blocks ~5x faster than cache[table] (measured).
    return cache.index_select(0, block_table[:num_blocks].clamp_min(0)).flatten(0, 1)[:num_tokens]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H, D].

    The inputs get a leading batch dimension: torch's CPU flash-attention kernel only takes
    4-D inputs, and 3-D ones fall back to the math path (4-40x slower, measured).
    """
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def causal_mask(len_q: int, len_k: int, window: int | None) -> torch.Tensor:
    """[len_q, len_k]: which keys each of the last len_q of len_k positions sees."""
    q_pos = torch.arange(len_k - len_q, len_k)[:, None]
    k_pos = torch.arange(len_k)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """q [Lq, H, D] over k/v [Lk, Hkv, D] with a [Lq, Lk] mask; soft-capped scores take the
    math path in fp32 (SDPA has no soft-cap)."""
    if softcap is None:
        return _sdpa(q, k, v, scale, mask=mask)
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).float() for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def new_tokens_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of a prompt (nothing cached before it) over its own tokens."""
    if window is None and softcap is None:
        return _sdpa(q, k, v, scale, causal=True)
    return _attend(q, k, v, scale, causal_mask(len(q), len(q), window), softcap)


def cached_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, len_k: int, scale: float,
                            window: int | None = None, softcap: float | None = None
                            ) -> torch.Tensor:
    """One sequence's len_q new tokens (already stored) over all its len_k cached tokens."""
    # (a bf16 cache under fp32 rows widened, an int8 one dequantized)
    keys, values = (kv_quant.dequantize(gather_kv(c, block_table, len_k), q.dtype)
                    for c in (k_cache, v_cache))
    return _attend(q, keys, values, scale, causal_mask(q.shape[0], len_k, window), softcap)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, ctx: Context, scale: float, first_row: int = 0,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each packed prompt (or chunk) over its cached prefix and its new
    tokens. q, k, v hold the tokens of rows first_row.. of the context."""
    assert ctx.seqlens_q is not None and ctx.seqlens_k is not None
    out = torch.empty_like(q)
    start = 0
    for i in range(first_row, len(ctx.seqlens_q)):
        len_q, len_k = ctx.seqlens_q[i], ctx.seqlens_k[i]
        end = start + len_q
        if len_k == len_q:  # nothing cached: attend over the new tokens themselves
            out[start:end] = new_tokens_attention(q[start:end], k[start:end], v[start:end], scale,
                                                  window, softcap)
        else:
            assert ctx.block_tables is not None
            out[start:end] = cached_prefix_attention(q[start:end], k_cache, v_cache,
                                                     ctx.block_tables[i], len_k, scale,
                                                     window, softcap)
        start = end
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     ctx: Context, scale: float, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One new token per sequence attends to its context_lens cached tokens via the block
    table (the first len(q) rows of the context)."""
    assert ctx.block_tables is not None and ctx.context_lens is not None
    block_size = k_cache.shape[1]
    tables = ctx.block_tables[:len(q)].clamp_min(0)              # -1 padding -> any valid block
    keys = kv_quant.dequantize(k_cache[tables].flatten(1, 2), q.dtype)  # [B, max_len, Hkv, D]
    values = kv_quant.dequantize(v_cache[tables].flatten(1, 2), q.dtype)
    max_len = tables.shape[1] * block_size
    lens = ctx.context_lens[:len(q), None]
    valid = torch.arange(max_len) < lens  # [B, max_len]
    if window is not None:
        valid &= torch.arange(max_len) >= lens - window
    if softcap is not None:  # the math path, every row at once
        group = q.shape[1] // keys.shape[2]
        keys, values = (t.repeat_interleave(group, dim=2).float() for t in (keys, values))
        scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~valid[:, None, :],
                                                                      float("-inf"))
        return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values).to(q.dtype)
    o = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2),
                                       values.transpose(1, 2), attn_mask=valid[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    return o[:, :, 0, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    if k_cache.numel():
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    if not ctx.is_prefill:
        return decode_attention(q, k_cache, v_cache, ctx, scale, window, softcap)
    k, v = as_stored(k, v, k_cache, v_cache, ctx.slot_mapping)  # (decode rows read the cache only)
    d = ctx.num_decodes  # a mixed batch: decode rows first, one token each
    if d == 0:
        return prefill_attention(q, k, v, k_cache, v_cache, ctx, scale, 0, window, softcap)
    return torch.cat([decode_attention(q[:d], k_cache, v_cache, ctx, scale, window, softcap),
                      prefill_attention(q[d:], k[d:], v[d:], k_cache, v_cache, ctx, scale,
                                        d, window, softcap)])
