"""CPU paged attention with a C++ kernel that reads the KV blocks in place.

torch_native's decode gathers every sequence's whole padded context out of the cache in
every layer of every step (a full copy of the live KV cache per step); this kernel walks
the block tables instead. It is one of pagedllm's C++ kernels (pagedllm/kernels); if that fails the engine falls back to torch_native, which stays the reference.

Per row of the batch (num cached tokens, num new tokens): rows with few new tokens
(decodes, short chunks over a cached prefix) take the kernel; a prompt with nothing cached
takes torch's flash attention over its own new tokens; a long chunk over a cached prefix
gathers its context once and takes torch's SDPA (the gather is amortised over the chunk).

Cascade attention: when several of the kernel's rows begin with the same blocks (a prompt
prefix they share through the prefix cache, e.g. a system prompt), attention over those
blocks runs once for all their queries as one dense flash-attention call (the prefix is
read once per layer instead of once per row, and the matmuls run on the CPU's matrix
units), and the kernel reads only each row's own blocks, merging the two parts by their
log-sum-exp. Rows are grouped by their first block, so several prefixes can each have
their group.

Windows (a query at position p sees keys p - window + 1 .. p) and soft-capped scores run in
the same kernels: the paged kernel reads each row from its first query's window on (so the
blocks before it, which the block manager may have freed, are never read), the prompt
kernel skips the key tiles before each block of queries' windows. Such layers take no
cascade (a shared prefix's keys are not all in every window). torch_native stays the path
where the kernels cannot run and the reference.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from pagedllm.attention import kv_quant, torch_native
from pagedllm.attention.context import Context
from pagedllm.kernels import ops, probes

FEATURES = torch_native.FEATURES

# Rows with at most this many new tokens over a cached prefix run in the kernel.
MAX_KERNEL_QUERY_LEN = 32
# Cascade attention pays when enough rows share a long enough prefix.
CASCADE_MIN_ROWS = 4
CASCADE_MIN_TOKENS = 256
# The head sizes the prompt-attention kernel is compiled for (SmolLM2's, Qwen3's and Llama 3's,
# Gemma's).
PROMPT_KERNEL_HEAD_DIMS = (64, 128, 256)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                    q_lens: torch.Tensor, k_lens: torch.Tensor, scale: float,
                    prefix_out: torch.Tensor | None = None,
                    prefix_lse: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> None:
    """Write into out the causal attention of rows' new tokens over their paged K/V.

    Row i's q_lens[i] tokens sit at q[q_starts[i]:] and follow k_lens[i] - q_lens[i] cached
    tokens; all k_lens[i] K/V vectors (the new ones too) are already in the cache. With
    prefix_out [T, H, D] and prefix_lse [T, H] (each query's attention over keys that come
    before its row's table, and the log-sum-exp of their scores), the result is attention
    over both. window / softcap: as torch_native's (None: none).
    """
    ops.paged_attention(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, scale,
                        prefix_out, prefix_lse, window or 0, softcap or 0.0)


@dataclass(frozen=True)
class SharedPrefix:
    """Blocks that a group of kernel rows all start with."""

    blocks: torch.Tensor
    tokens: torch.Tensor | None  # the group's query tokens in q (None: all of q, in order)

    @functools.cached_property
    def cache_index(self) -> torch.Tensor | slice:
        """The blocks as a slice if they are adjacent (a prompt's prefill takes a run of
        free blocks), so the prefix is a view of the cache rather than a copy."""
        first, n = int(self.blocks[0]), len(self.blocks)
        adjacent = bool((self.blocks == torch.arange(first, first + n)).all())
        return slice(first, first + n) if adjacent else self.blocks


@dataclass(frozen=True)
class KernelRows:
    """The rows of one step that take the kernel, worked out once per step."""

    rows: list[int]            # indices into the context's rows
    tables: torch.Tensor       # their block tables, each without its shared prefix if any
    q_starts: torch.Tensor     # where each row's new tokens start in q
    q_lens: torch.Tensor
    k_lens: torch.Tensor       # keys per row, without its shared prefix if any
    prefixes: tuple[SharedPrefix, ...] = ()  # cascade attention's shared prefixes


def _shared_blocks(tables: torch.Tensor, q_lens: list[int], k_lens: list[int],
                   block_size: int) -> int:
    """Whole blocks that every table starts with and that lie before every row's first new
    token; 0 if fewer than CASCADE_MIN_TOKENS tokens' worth."""
    shared = min(k - q for q, k in zip(q_lens, k_lens)) // block_size
    if shared * block_size >= CASCADE_MIN_TOKENS:
        differs = (~(tables[:, :shared] == tables[:1, :shared]).all(0)).nonzero()
        shared = int(differs[0]) if len(differs) else shared
    return shared if shared * block_size >= CASCADE_MIN_TOKENS else 0


def plan_kernel_rows(rows: list[int], tables: torch.Tensor, q_starts: list[int],
                     q_lens: list[int], k_lens: list[int], block_size: int,
                     cascade: bool = True) -> KernelRows:
    """The kernel's inputs for these rows. Rows that start with the same block form a
    group; a group of at least CASCADE_MIN_ROWS rows whose tables share a long enough run
    of whole blocks before every row's first new token (_shared_blocks) is a cascade: the
    run is cut off its rows' tables and attended separately, once for the group (unless
    cascade is False: windowed or soft-capped layers)."""
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
    skip = [0] * len(rows)   # each row's shared blocks
    groups: dict[int, list[int]] = {}
    if cascade and len(rows) >= CASCADE_MIN_ROWS:
        for i, first in enumerate(tables[:, 0].tolist()):
            groups.setdefault(first, []).append(i)
    prefixes = []
    for members in groups.values():
        if len(members) < CASCADE_MIN_ROWS:
            continue
        shared = _shared_blocks(tables[members], [q_lens[i] for i in members],
                                [k_lens[i] for i in members], block_size)
        if not shared:
            continue
        for i in members:
            skip[i] = shared
        tokens = None
        if len(members) < len(rows) or q_starts != list(range(len(rows))):
            tokens = torch.cat([torch.arange(q_starts[i], q_starts[i] + q_lens[i])
                                for i in members])
        prefixes.append(SharedPrefix(tables[members[0], :shared].clone(), tokens))
    if prefixes:  # each row's table shifted left by its shared blocks (-1 padded)
        width = tables.shape[1]
        shift = as_tensor(skip)[:, None] + torch.arange(width)
        tables = tables.gather(1, shift.clamp_max(width - 1)).masked_fill(shift >= width, -1)
    return KernelRows(rows, tables.contiguous(), as_tensor(q_starts), as_tensor(q_lens),
                      as_tensor([k - n * block_size for k, n in zip(k_lens, skip)]),
                      tuple(prefixes))


def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     blocks: torch.Tensor | slice, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query q [T, H, D] over all the keys of these blocks (ids, or a slice of
    adjacent ones; no mask: they all come before every query): the output [T, H, D] and the
    log-sum-exp of the scores [T, H].

    One call for all queries: pagedllm's kernel where it runs (prompt_kernel), else
    torch's flash attention with the query heads that share a KV head stacked along the
    query axis, so that the call sees num_kv_heads heads of T * group queries.
    """
    num_tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    if isinstance(blocks, slice):  # adjacent blocks: a view of the cache, no copy
        keys, values = k_cache[blocks], v_cache[blocks]
    else:  # index_select copies whole blocks ~5x faster than advanced indexing (measured)
        keys, values = (c.index_select(0, blocks) for c in (k_cache, v_cache))
    # (a bf16 cache under fp32 rows, an int8 cache)
    keys, values = kv_quant.dequantize(keys, q.dtype), kv_quant.dequantize(values, q.dtype)
    if prompt_kernel(q):  # pagedllm's kernel, without a mask
        out = torch.empty(q.shape, dtype=q.dtype)
        lse = ops.attention_over_keys(out, q, keys.flatten(0, 1), values.flatten(0, 1), scale,
                                      False)
        return out, lse
    keys = keys.flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, P, D]
    values = values.flatten(0, 1).transpose(0, 1)[None]
    queries = q.view(num_tokens, kv_heads, group, dim).permute(1, 0, 2, 3)
    queries = queries.reshape(1, kv_heads, num_tokens * group, dim)
    out, lse = ops.flash_attention_with_lse(queries, keys, values, scale)
    out = out[0].view(kv_heads, num_tokens, group, dim).permute(1, 0, 2, 3)
    lse = lse[0].view(kv_heads, num_tokens, group).permute(1, 0, 2)
    return out.reshape(num_tokens, heads, dim), lse.reshape(num_tokens, heads)


def kernel_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, plan: KernelRows, scale: float,
                     window: int | None = None, softcap: float | None = None) -> None:
    """The plan's rows' tokens of out, as a cascade if the plan has shared prefixes (never
    with a window or soft-cap)."""
    assert not (plan.prefixes and (window is not None or softcap is not None))
    prefix_out = prefix_lse = None
    if len(plan.prefixes) == 1 and plan.prefixes[0].tokens is None:  # every row, all of q
        prefix_out, prefix_lse = prefix_attention(q, k_cache, v_cache,
                                                  plan.prefixes[0].cache_index, scale)
    elif plan.prefixes:
        # Tokens of rows outside every group merge with nothing: weight 0 (lse -inf), and
        # zeros rather than garbage (0 * NaN would be NaN).
        prefix_out = torch.zeros_like(q)
        prefix_lse = torch.full(q.shape[:2], float("-inf"))
        for prefix in plan.prefixes:
            part_out, part_lse = prefix_attention(q[prefix.tokens], k_cache, v_cache,
                                                  prefix.cache_index, scale)
            prefix_out[prefix.tokens] = part_out
            prefix_lse[prefix.tokens] = part_lse
    paged_attention(out, q, k_cache, v_cache, plan.tables, plan.q_starts, plan.q_lens,
                    plan.k_lens, scale, prefix_out, prefix_lse, window, softcap)


def _cached_plan(ctx: Context, key: object, make) -> KernelRows:
    plan = ctx.backend_plans.get(key)
    if plan is None:
        plan = ctx.backend_plans[key] = make()
    return plan


def decode_plan(ctx: Context, n: int, block_size: int, cascade: bool = True) -> KernelRows:
    """The kernel's rows for the context's first n rows, one new token each (made once per
    step: every layer shares it, or each kind of layer, with and without cascade)."""
    assert ctx.block_tables is not None and ctx.context_lens is not None

    def make() -> KernelRows:
        return plan_kernel_rows(list(range(n)), ctx.block_tables[:n], list(range(n)), [1] * n,
                                ctx.context_lens[:n].tolist(), block_size, cascade)

    return _cached_plan(ctx, ("decode", n) if cascade else ("decode", n, "no cascade"), make)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     ctx: Context, scale: float, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One new token per row (the first len(q) rows of the context)."""
    out = torch.empty(q.shape, dtype=q.dtype)
    if window is None and softcap is None:
        plan = decode_plan(ctx, q.shape[0], k_cache.shape[1])
    else:
        plan = decode_plan(ctx, q.shape[0], k_cache.shape[1], cascade=False)
    kernel_attention(out, q, k_cache, v_cache, plan, scale, window, softcap)
    return out


def gather_window(cache: torch.Tensor, block_table: torch.Tensor, start: int,
                  end: int) -> torch.Tensor:
    """One sequence's cached K (or V) vectors of positions [start, end): [end - start,
    kv_heads, dim], read from start's block on (entries before it are not read)."""
    block_size = cache.shape[1]
    first, last = start // block_size, (end + block_size - 1) // block_size
    offset = start - first * block_size
    blocks = cache.index_select(0, block_table[first:last]).flatten(0, 1)
    return blocks[offset:offset + end - start]


def attention_kernel(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over new tokens or a shared prefix takes pagedllm's kernel
    (csrc/prompt_attention.cpp): bf16, head_dim in PROMPT_KERNEL_HEAD_DIMS, a build with
    AVX512-BF16. It runs on AMX tiles where the CPU and kernel allow them (1.6-1.9x torch's
    flash attention), else on AVX512-BF16 dot products (several times torch's there, which
    computes in fp32)."""
    return (dtype == torch.bfloat16 and head_dim in PROMPT_KERNEL_HEAD_DIMS
            and probes.prompt_attention_isa() != "")


def prompt_kernel(q: torch.Tensor) -> bool:
    return attention_kernel(q.dtype, q.shape[-1])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, ctx: Context, scale: float,
                      first_row: int = 0, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Rows first_row.. of the context, their new tokens packed in q, k, v."""
    assert ctx.seqlens_q is not None and ctx.seqlens_k is not None
    out = torch.empty(q.shape, dtype=q.dtype)
    kernel_rows: list[tuple[int, int, int, int]] = []   # (row, q_start, q_len, k_len)
    prompts: list[tuple[int, int]] | None = [] if prompt_kernel(q) else None
    start = 0
    for i in range(first_row, len(ctx.seqlens_q)):
        len_q, len_k = ctx.seqlens_q[i], ctx.seqlens_k[i]
        end = start + len_q
        if len_k == len_q and prompts is not None:
            prompts.append((start, len_q))
        elif len_k == len_q:
            out[start:end] = torch_native.new_tokens_attention(q[start:end], k[start:end],
                                                               v[start:end], scale, window,
                                                               softcap)
        elif len_q <= MAX_KERNEL_QUERY_LEN:
            kernel_rows.append((i, start, len_q, len_k))
        elif prompts is not None:  # the kernel over the gathered context
            assert ctx.block_tables is not None
            # from the first query's window on (positions are relative: the queries are
            # the last len_q of the keys either way)
            first = 0 if window is None else max(0, len_k - len_q - window + 1)
            keys, values = (kv_quant.dequantize(gather_window(c, ctx.block_tables[i], first,
                                                              len_k), q.dtype)
                            for c in (k_cache, v_cache))
            ops.attention_over_keys(out[start:end], q[start:end], keys, values, scale, True,
                                    window or 0, softcap or 0.0)
        elif window is not None:  # torch's, over the keys from the first query's window on
            assert ctx.block_tables is not None
            first = max(0, len_k - len_q - window + 1)
            keys, values = (kv_quant.dequantize(gather_window(c, ctx.block_tables[i], first,
                                                              len_k), q.dtype)
                            for c in (k_cache, v_cache))
            mask = torch_native.causal_mask(len_q, len_k - first, window)
            out[start:end] = torch_native._attend(q[start:end], keys, values, scale, mask, softcap)
        else:
            assert ctx.block_tables is not None
            out[start:end] = torch_native.cached_prefix_attention(
                q[start:end], k_cache, v_cache, ctx.block_tables[i], len_k, scale, None, softcap)
        start = end
    if prompts:  # every prompt with nothing cached, in one call
        starts, lens = (torch.tensor(c, dtype=torch.int64) for c in zip(*prompts))
        ops.prompt_attention(out, q, k, v, starts, lens, scale, window or 0, softcap or 0.0)
    if kernel_rows:
        plan = _prefill_plan(ctx, first_row, kernel_rows, k_cache.shape[1],
                             cascade=window is None and softcap is None)
        kernel_attention(out, q, k_cache, v_cache, plan, scale, window, softcap)
    return out


def _prefill_plan(ctx: Context, first_row: int, kernel_rows: list[tuple[int, int, int, int]],
                  block_size: int, cascade: bool) -> KernelRows:
    """prefill_attention's plan of its kernel rows, (row, q_start, q_len, k_len) each, q_start
    counted from first_row's first token (made once per step, as decode_plan)."""
    assert ctx.block_tables is not None

    def make() -> KernelRows:
        rows, q_starts, q_lens, k_lens = (list(c) for c in zip(*kernel_rows))
        return plan_kernel_rows(rows, ctx.block_tables[rows], q_starts, q_lens, k_lens,
                                block_size, cascade)

    key = ("prefill", first_row) if cascade else ("prefill", first_row, "no cascade")
    return _cached_plan(ctx, key, make)


def short_rows_plan(ctx: Context, block_size: int, cascade: bool = True) -> KernelRows | None:
    """One plan for a whole step whose rows all take the kernel: decodes, then rows of at
    most MAX_KERNEL_QUERY_LEN new tokens over a cached prefix (drafts being verified, a
    short chunk); None for any other step, or where a cascade would take part of it. Its
    rows' plans are the ones decode_attention and prefill_attention make for the step (the
    kernel computes each row on its own), so the results are theirs bit for bit."""
    assert ctx.seqlens_q is not None and ctx.seqlens_k is not None
    n = ctx.num_decodes
    if not all(len_k > len_q and len_q <= MAX_KERNEL_QUERY_LEN
               for len_q, len_k in zip(ctx.seqlens_q[n:], ctx.seqlens_k[n:])):
        return None
    starts = itertools.accumulate(ctx.seqlens_q[n:-1], initial=0)
    rows = list(zip(range(n, len(ctx.seqlens_q)), starts, ctx.seqlens_q[n:], ctx.seqlens_k[n:]))
    plans = ([decode_plan(ctx, n, block_size, cascade)] if n else []) + \
        [_prefill_plan(ctx, n, rows, block_size, cascade)]
    if any(plan.prefixes for plan in plans):
        return None
    width = max(plan.tables.shape[1] for plan in plans)
    tables = torch.cat([torch.nn.functional.pad(plan.tables, (0, width - plan.tables.shape[1]),
                                                value=-1) for plan in plans])
    q_starts = torch.cat([plans[0].q_starts] + [p.q_starts + n for p in plans[1:]])
    return KernelRows(list(range(len(ctx.seqlens_q))), tables, q_starts,
                      torch.cat([p.q_lens for p in plans]), torch.cat([p.k_lens for p in plans]))


def longest_context(ctx: Context) -> int:
    """The step's longest row in tokens (cached and new), 0 if the context does not say."""
    if ctx.seqlens_k:
        return max(ctx.seqlens_k)
    if ctx.context_lens is not None and len(ctx.context_lens):
        return int(ctx.context_lens.max())
    return 0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Same contract as torch_native.attention."""
    if window is not None and 0 < longest_context(ctx) <= window:
        window = None  # every row's context fits in the window: it hides nothing
    if not k_cache.numel():  # no cache bound (profiling runs): nothing to read in place
        return torch_native.attention(q, k, v, k_cache, v_cache, ctx, scale, window, softcap)
    ops.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    if ctx.is_prefill:  # (decode rows read the cache only)
        k, v = torch_native.as_stored(k, v, k_cache, v_cache, ctx.slot_mapping)
    # q is a view into the step's qkv projection: the kernel reads it in place (a copy cost
    # 21 us per layer at 64 rows); the output is contiguous.
    if not ctx.is_prefill:
        return decode_attention(q, k_cache, v_cache, ctx, scale, window, softcap)
    num_decodes = ctx.num_decodes  # a mixed batch (chunked prefill): decode rows come first
    if num_decodes == 0:
        return prefill_attention(q, k, v, k_cache, v_cache, ctx, scale, 0, window, softcap)
    return torch.cat([decode_attention(q[:num_decodes], k_cache, v_cache, ctx, scale, window,
                                       softcap),
                      prefill_attention(q[num_decodes:], k[num_decodes:], v[num_decodes:],
                                        k_cache, v_cache, ctx, scale, num_decodes, window,
                                        softcap)])
