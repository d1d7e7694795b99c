"""Paged attention in Triton: the GPU backend when flash-attn is absent (seed 002, issue 28).

Three kernels with torch_native's shapes and meaning (sliding window and logit soft-cap
included):
  store_kvcache     one program per new token writes its K and V into its slot (-1 = skip,
                    which padded CUDA-graph rows rely on).
  prefill           FlashAttention-style tiles of BLOCK_M queries of one sequence and one
                    query head: first over the cached prefix through the block table, then
                    over the new tokens (packed k, v), causally; online softmax in fp32. Key
                    tiles wholly above the diagonal or before the window are never visited.
  decode            split-K ("flash-decoding"): one program per (sequence, KV head, split of
                    SPLIT tokens) attends with all the query heads of its KV head at once
                    (the GQA group padded to 16 rows for tl.dot) and writes a partial
                    (max, sum, acc); a second kernel merges a row's splits in order.
Key tiles of BLOCK_N tokens may span several cache blocks: each token finds its block as
block_table[n // block_size], so tiles are sized for the tensor cores, not the blocks.

The decode launch depends on shapes only (the grid has cdiv(table width * block_size,
SPLIT) splits, SPLIT fixed), so CUDA graphs can capture it; splits past a row's context
exit at once and are never read, so the result does not depend on the table width, and a
row of context length 0 (a padded graph row) gets zeros.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (slowly): that is how they are
tested without a GPU. fp32 inputs use input_precision="ieee" in every tl.dot (no TF32, so
fp32 greedy outputs match HF's); fp16 / bf16 inputs use the tensor cores' default.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.context import Context

# What attention() takes besides plain causal attention (see layers/attention.py).
FEATURES = frozenset({"sliding_window", "logit_softcap"})

LOG2E = 1.4426950408889634

# Prefill tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) by (element bytes, padded
# head_dim). Shared memory holds the Q tile and, per pipeline stage, a K and a V tile; fp32
# runs "ieee" dots on the FMA units, which want smaller tiles than the tensor cores. Each
# entry was compiled for sm_90 here (triton's ptxas, 16-byte-aligned strides as the JIT
# sees them): registers / shared memory, no spills; the bf16 / fp16 ones are the
# FlashAttention tutorial's shapes, not yet timed on a GPU (scripts/gpu_attention_bench.py
# sweeps a few).
PREFILL_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (2, 16): (128, 64, 8, 3), (2, 32): (128, 64, 8, 3),
    (2, 64): (128, 64, 8, 3),     # 152 regs, 64 KB
    (2, 128): (128, 64, 8, 2),    # 231 regs, 96 KB
    (2, 256): (64, 32, 8, 2),     # 202 regs, 96 KB
    (4, 16): (32, 32, 4, 2), (4, 32): (32, 32, 4, 2),
    (4, 64): (32, 32, 4, 2),      # 114 regs, 28 KB
    (4, 128): (32, 32, 8, 2),     # 106 regs, 52 KB (4 warps: 255 regs + 800 B spilled)
    (4, 256): (32, 16, 8, 2),     # 156 regs, 66 KB
}
# Decode (BLOCK_N keys per iteration, num_warps) by (element bytes, padded head_dim); the
# GQA group is padded to 16 query rows. Same check as above: no spills.
DECODE_TILES: dict[tuple[int, int], tuple[int, int]] = {
    (2, 16): (64, 4), (2, 32): (64, 4), (2, 64): (64, 4),
    (2, 128): (64, 4),            # 124 regs, 38 KB
    (2, 256): (32, 4),            # 160 regs, 41 KB
    (4, 16): (32, 4), (4, 32): (32, 4),
    (4, 64): (32, 4),             # 80 regs
    (4, 128): (32, 8),            # 80 regs (4 warps: 255 regs + 456 B spilled)
    (4, 256): (16, 4),            # 168 regs, 49 KB
}


def _tile_key(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    if head_dim > 256:
        raise ValueError(f"the triton attention kernels take head_dim <= 256, got {head_dim}")
    return (4 if dtype == torch.float32 else 2, _padded(head_dim))


def prefill_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    return PREFILL_TILES[_tile_key(dtype, head_dim)]


def decode_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode split kernel; SPLIT is a multiple of BLOCK_N."""
    return DECODE_TILES[_tile_key(dtype, head_dim)]


def decode_split(head_dim: int) -> int:
    """Tokens per decode split: fixed per head size (never from the batch), so that the
    grid depends on shapes only. 256 tokens of K and V at head_dim 128 in bf16 are 128 KB,
    enough work per program; one sequence of 4096 tokens with 8 KV heads makes 128
    programs (an H100 has 132 SMs)."""
    return 256 if head_dim <= 128 else 512


def _padded(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" = the default: unused by 16-bit


def _score_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_log2e) for _scores: scores come out in log2 units (for exp2)."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return scale / softcap, softcap * LOG2E


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
def _tanh(x):
    """tanh from exp2 (the interpreter has no libdevice): a Taylor series below 0.25, where
    1 - exp(-2|x|) would cancel; relative error ~3e-7 in fp32."""
    ax = tl.abs(x)
    t = tl.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    y = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scores(qk, qk_scale, cap_log2e, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k -> scale (and soft-cap) -> log2 units for exp2."""
    if HAS_SOFTCAP:
        return _tanh(qk * qk_scale) * cap_log2e
    return qk * qk_scale


@triton.jit
def _load_paged_kv(k_cache_ptr, v_cache_ptr, table, tok, valid, kv_head, c_sb, c_st, c_sh,
                   offs_d, d_mask, BLOCK_SIZE: tl.constexpr):
    """K and V [len(tok), D] of cached positions tok through a sequence's block table
    (zeros where not valid: entries there may be -1 and are never read)."""
    block = tl.load(table + tok // BLOCK_SIZE, mask=valid, other=0)
    row = block * c_sb + (tok % BLOCK_SIZE) * c_st + kv_head * c_sh
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """Fold scores s [M, N] (log2 units, masked = -inf) and values v [N, D] into the running
    (max, sum, acc). A row that has seen only masked keys keeps m = -inf without NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Integer arguments that change from step to step are not specialised on (Triton compiles a
# variant per "equals 1" / "divisible by 16" pattern of its integer arguments; a variant
# first met mid-run costs a compile of a second or more inside a timed step).
@triton.jit(do_not_specialize=["bt_stride", "first_row"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
                    cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_tables_ptr, bt_stride, first_row,
                    qk_scale, cap_log2e, window,
                    q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh, c_sb, c_st, c_sh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0) + first_row
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    len_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    len_k = tl.load(cu_seqlens_k_ptr + seq + 1) - tl.load(cu_seqlens_k_ptr + seq)
    prefix = len_k - len_q
    if m0 >= len_q:
        return
    kv_head = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)   # query i sits at position prefix + i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_P2)
    m_mask = offs_m < len_q
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * q_st + head * q_sh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)

    # 1. the cached prefix (positions 0 .. prefix-1) through the block table: visible to
    # every query of the tile, except what lies before a query's window
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0)   # the tile's first query's window
    table = block_tables_ptr + seq * bt_stride
    for n0 in range(lo - lo % BLOCK_N, prefix, BLOCK_N):
        tok = n0 + offs_n
        readable = (tok >= lo) & (tok < prefix)       # table entries before lo may be -1
        k, v = _load_paged_kv(k_cache_ptr, v_cache_ptr, table, tok, readable, kv_head,
                              c_sb, c_st, c_sh, offs_d, d_mask, BLOCK_SIZE)
        s = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale,
                    cap_log2e, HAS_SOFTCAP)
        visible = readable[None, :]
        if HAS_WINDOW:
            visible = visible & (tok[None, :] > (prefix + offs_m)[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    # 2. the new tokens themselves, causally: key j is visible to query i when j <= i
    # (and i - j < window); tiles past the tile's last query are skipped
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(m0 - window + 1, 0)
    hi = tl.minimum(m0 + BLOCK_M, len_q)
    for n0 in range(lo - lo % BLOCK_N, hi, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < len_q
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (q_start + n)[:, None] * k_st + kv_head * k_sh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (q_start + n)[:, None] * v_st + kv_head * v_sh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale,
                    cap_log2e, HAS_SOFTCAP)
        visible = n_mask[None, :] & (n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > offs_m[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * o_st + head * o_sh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["bt_stride", "num_splits"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr,
                         context_lens_ptr, block_tables_ptr, bt_stride, num_splits,
                         qk_scale, cap_log2e, window, q_ss, q_sh, c_sb, c_st, c_sh,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                         HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    lo = split * SPLIT                       # this split's keys: lo .. hi-1
    hi = tl.minimum(lo + SPLIT, context_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, context_len - window)
    if lo >= hi:                             # past the context or before the window
        return
    offs_g = tl.arange(0, GROUP_P2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_P2)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * q_ss + heads[:, None] * q_sh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
    table = block_tables_ptr + seq * bt_stride
    # Every tile holds at least one key in lo .. hi-1, so every row's max stays finite.
    for n0 in range(lo - lo % BLOCK_N, hi, BLOCK_N):
        tok = n0 + offs_n
        valid = (tok >= lo) & (tok < hi)     # table entries before a window may be -1
        k, v = _load_paged_kv(k_cache_ptr, v_cache_ptr, table, tok, valid, kv_head,
                              c_sb, c_st, c_sh, offs_d, d_mask, BLOCK_SIZE)
        s = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale,
                    cap_log2e, HAS_SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)
    part = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * D_P2 + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, context_lens_ptr, num_splits, window,
                          o_ss, o_sh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_P2: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Merge one (sequence, query head)'s splits, in order: the same sums whatever the
    number of (empty) splits after them."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    first = context_len * 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0) // SPLIT
    last = (context_len + SPLIT - 1) // SPLIT
    base = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits
    offs_d = tl.arange(0, D_P2)
    m_max = tl.full([1], float("-inf"), tl.float32)
    for s in range(first, last):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_P2], tl.float32)
    for s in range(first, last):
        w = tl.exp2(tl.load(m_ptr + base + s + tl.zeros([1], tl.int32)) - m_safe)
        l_sum += tl.load(l_ptr + base + s + tl.zeros([1], tl.int32)) * w
        acc += tl.load(acc_ptr + (base + s) * D_P2 + offs_d) * w
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)    # context length 0 -> zeros
    tl.store(o_ptr + seq * o_ss + head * o_sh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, ctx: Context, scale: float, o: torch.Tensor,
                      first_row: int = 0, window: int | None = None,
                      softcap: float | None = None,
                      tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Rows first_row.. of the context into o (q, k, v, o hold every row's tokens)."""
    assert ctx.cu_seqlens_q is not None and ctx.cu_seqlens_k is not None
    num_rows = ctx.cu_seqlens_q.numel() - 1 - first_row
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_m, block_n, num_warps, num_stages = tiles or prefill_tiles(q.dtype, head_dim)
    tables = ctx.block_tables
    if tables is None:  # nothing cached: the prefix loop never runs, any pointer will do
        tables = ctx.cu_seqlens_q
    bt_stride = tables.stride(0) if tables.dim() == 2 else 0
    qk_scale, cap_log2e = _score_args(scale, softcap)
    grid = (num_rows, num_heads, triton.cdiv(ctx.max_seqlen_q, block_m))
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, o, ctx.cu_seqlens_q, ctx.cu_seqlens_k, tables, bt_stride,
        first_row, qk_scale, cap_log2e, window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim, D_P2=_padded(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)
    return o


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     ctx: Context, scale: float, o: torch.Tensor | None = None,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One new token per row (the first len(q) rows of the context) over context_lens cached
    tokens; no host sync, a grid from shapes only (CUDA-graph safe)."""
    assert ctx.block_tables is not None and ctx.context_lens is not None
    o = torch.empty_like(q) if o is None else o
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return o
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    split = decode_split(head_dim)
    block_n, num_warps = decode_tiles(q.dtype, head_dim)
    d_p2 = _padded(head_dim)
    num_splits = triton.cdiv(ctx.block_tables.shape[1] * block_size, split)
    m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(num_seqs, num_heads, num_splits, d_p2, dtype=torch.float32,
                      device=q.device)
    qk_scale, cap_log2e = _score_args(scale, softcap)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, m, l, acc, ctx.context_lens, ctx.block_tables,
        ctx.block_tables.stride(0), num_splits, qk_scale, cap_log2e, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, GROUP_P2=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_P2=d_p2, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT=split,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=2)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        m, l, acc, o, ctx.context_lens, num_splits, window or 0, o.stride(0), o.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_P2=d_p2, SPLIT=split,
        HAS_WINDOW=window is not None, num_warps=4 if d_p2 >= 128 else 1)
    return o


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    if k_cache.numel():
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    if not ctx.is_prefill:
        return decode_attention(q, k_cache, v_cache, ctx, scale, None, window, softcap)
    o = torch.empty_like(q)
    d = ctx.num_decodes  # a mixed batch: decode rows first, one token each
    if d:
        decode_attention(q[:d], k_cache, v_cache, ctx, scale, o[:d], window, softcap)
    return prefill_attention(q, k, v, k_cache, v_cache, ctx, scale, o, d, window, softcap)
