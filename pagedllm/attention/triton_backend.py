"""Paged attention in Triton: the GPU backend when flash-attn is absent (seed 002).

Three kernels with torch_native's shapes and meaning:
  store_kvcache     one program per new token writes its K and V into its slot (-1 = skip,
                    which padded CUDA-graph rows rely on).
  prefill           FlashAttention-style tiles of BLOCK_M queries of one sequence and one
                    head: first over the cached prefix through the block table, then over
                    the new tokens (packed k, v), causally; online softmax in fp32.
  decode            one program per (sequence, head) walks the sequence's blocks.
Under TRITON_INTERPRET=1 they run on CPU tensors (slowly): that is how they are tested here.
Dot products use input_precision="ieee" so fp32 stays fp32 (no TF32 on Ampere+).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.context import Context

# Queries per prefill program and new keys per iteration. Equal, so that every query row
# sees at least one key in each iteration of the causal loop (its running max stays finite).
BLOCK_M = BLOCK_N = 16


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_stride, v_stride, k_cache_ptr, v_cache_ptr,
                          slot_mapping_ptr, D: tl.constexpr, D_P2: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:
        return
    offs = tl.arange(0, D_P2)
    mask = offs < D
    k = tl.load(k_ptr + token * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + token * v_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * D + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * D + offs, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [N, Hkv, D] (rows contiguous) -> the caches [blocks, block_size, Hkv, D]."""
    n, num_kv_heads, head_dim = k.shape
    d = num_kv_heads * head_dim
    assert k.stride(-1) == 1 and k.stride(1) == head_dim and v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == n
    if n:
        _store_kvcache_kernel[(n,)](k, v, k.stride(0), v.stride(0), k_cache, v_cache,
                                    slot_mapping, D=d, D_P2=triton.next_power_of_2(d))


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v):
    """Fold scores s [M, N] (masked = -inf) and values v [N, D] into the running state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
                    cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_tables_ptr, bt_stride, scale,
                    q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh, c_sb, c_st, c_sh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    len_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    len_k = tl.load(cu_seqlens_k_ptr + seq + 1) - tl.load(cu_seqlens_k_ptr + seq)
    prefix = len_k - len_q
    if tile * BLOCK_M >= len_q:
        return
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_P2)
    m_mask = offs_m < len_q
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * q_st + head * q_sh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    # 1. the cached prefix, block by block through the block table: visible to every query
    offs_b = tl.arange(0, BLOCK_SIZE)
    for b in range(0, tl.cdiv(prefix, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * bt_stride + b)
        n_mask = b * BLOCK_SIZE + offs_b < prefix
        kv_off = block * c_sb + offs_b[:, None] * c_st + kv_head * c_sh + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)
    # 2. the new tokens themselves, causally: key j is visible to query i when j <= i
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, tl.minimum((tile + 1) * BLOCK_M, len_q), BLOCK_N):
        n = n0 + offs_n
        n_mask = n < len_q
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (q_start + n)[:, None] * k_st + kv_head * k_sh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (q_start + n)[:, None] * v_st + kv_head * v_sh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = n_mask[None, :] & (n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * o_st + head * o_sh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, context_lens_ptr, block_tables_ptr,
                   bt_stride, scale, q_ss, q_sh, o_ss, o_sh, c_sb, c_st, c_sh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_d = tl.arange(0, D_P2)
    d_mask = offs_d < HEAD_DIM
    offs_b = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * q_ss + head * q_sh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_P2], tl.float32)
    for b in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * bt_stride + b)
        n_mask = b * BLOCK_SIZE + offs_b < context_len
        kv_off = block * c_sb + offs_b[:, None] * c_st + kv_head * c_sh + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * scale
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)   # context_len 0 (a padded graph row) -> zeros
    tl.store(o_ptr + seq * o_ss + head * o_sh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=d_mask)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
    assert ctx.cu_seqlens_q is not None and ctx.cu_seqlens_k is not None
    o = torch.empty_like(q)
    num_seqs = ctx.cu_seqlens_q.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    tables = ctx.block_tables
    if tables is None:  # nothing cached: the prefix loop never runs, any pointer will do
        tables = ctx.cu_seqlens_q
    bt_stride = tables.stride(0) if tables.dim() == 2 else 0
    grid = (num_seqs, num_heads, triton.cdiv(ctx.max_seqlen_q, BLOCK_M))
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, o, ctx.cu_seqlens_q, ctx.cu_seqlens_k, tables, bt_stride,
        scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim,
        D_P2=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return o


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     ctx: Context, scale: float) -> torch.Tensor:
    assert ctx.block_tables is not None and ctx.context_lens is not None
    o = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _decode_kernel[(num_seqs, num_heads)](
        q, k_cache, v_cache, o, ctx.context_lens, ctx.block_tables, ctx.block_tables.stride(0),
        scale, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim,
        D_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1])
    return o


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
    if k_cache.numel():
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    if ctx.is_prefill:
        return prefill_attention(q, k, v, k_cache, v_cache, ctx, scale)
    return decode_attention(q, k_cache, v_cache, ctx, scale)
