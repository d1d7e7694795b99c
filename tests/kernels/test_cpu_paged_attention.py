"""The C++ CPU paged-attention kernel against a dense causal attention in float64.

Random, non-contiguous block tables; GQA; ragged lengths; cached prefixes; decode rows
(q_len 1), short chunks over a cached prefix and whole prompts in one varlen batch.
"""
from __future__ import annotations

import os

import pytest
import torch

from cpu_features import cpu_flags
from pagedllm.kernels import build
from pagedllm.attention import cpu_paged, torch_native
from pagedllm.attention.context import Context


@pytest.fixture(scope="module", autouse=True)
def kernel_builds():
    """The kernel must build here (gcc + ninja are part of the setup): fail, never skip."""
    assert (build.load() is not None), build.load_error


@pytest.fixture(scope="module", autouse=True, params=["avx512_bf16", "avx512"])
def bf16_scores(request, kernel_builds):
    """Every test runs on each way the CPU can score bf16 keys: AVX512-BF16 dot products,
    and keys widened to fp32 (on a CPU with dot products, turned off for the module; on
    one with AMX, the default, dot products turned on). Only a CPU without the
    instructions skips, and says so."""
    needs = {"avx512_bf16": {"avx512_bf16", "avx512bw"}, "avx512": {"avx512f", "avx512bw"}}
    if not needs[request.param] <= cpu_flags():
        pytest.skip(f"this CPU has no {request.param}: that path of the kernel is not run here")
    ext = build.load()
    dot_before = ext.paged_attention_scores() == "avx512_bf16"  # (this CPU's default)
    ext.allow_dot_scores(request.param == "avx512_bf16")
    try:
        assert ext.paged_attention_scores() == request.param
        yield request.param
    finally:
        ext.allow_dot_scores(dot_before)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D] are the last Lq positions of k/v [Lk, Hkv, D]; causal, GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Batch:
    """Sequences with random K/V laid out in a paged cache through shuffled block tables."""

    def __init__(self, rows: list[tuple[int, int]], heads: int, kv_heads: int, dim: int,
                 block_size: int, dtype: torch.dtype, seed: int, shared_blocks: int = 0,
                 groups: list[int | None] | None = None) -> None:
        """Rows of the same group (groups[i]; by default group 0 = every row with at least
        shared_blocks blocks cached) start their tables with the same shared_blocks blocks,
        holding the same tokens: a prefix shared through the prefix cache."""
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.block_size = rows, block_size   # rows: (num cached, num new)
        need = [-(-(c + n) // block_size) for c, n in rows]
        num_blocks = sum(need) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        shared = shared_blocks * block_size
        if groups is None:
            groups = [0 if shared_blocks and c >= shared else None for c, _ in rows]
        prefixes = {g: [perm.pop() for _ in range(shared_blocks)] for g in set(groups) - {None}}
        self.tables = [prefixes[g] + [perm.pop() for _ in range(m - shared_blocks)]
                       if g is not None else [perm.pop() for _ in range(m)]
                       for m, g in zip(need, groups)]
        width = max(need)
        self.block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in self.tables])
        # Garbage (not zeros) in unused slots: the kernel must never read them.
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype) * 1e3
        self.v_cache = torch.randn_like(self.k_cache) * 1e3
        self.k = [torch.randn(c + n, kv_heads, dim, generator=gen).to(dtype) for c, n in rows]
        self.v = [torch.randn(c + n, kv_heads, dim, generator=gen).to(dtype) for c, n in rows]
        self.q = [torch.randn(n, heads, dim, generator=gen).to(dtype) for _, n in rows]
        first = {g: groups.index(g) for g in prefixes}
        for kv in (self.k, self.v):
            for i, g in enumerate(groups):
                if g is not None:
                    kv[i][:shared] = kv[first[g]][:shared]
        for i, (c, n) in enumerate(rows):  # every token, new ones included, is in the cache
            slots = torch.tensor(self.slots(i, 0, c + n))
            torch_native.store_kvcache(self.k[i], self.v[i], self.k_cache, self.v_cache, slots)

    def slots(self, row: int, start: int, end: int) -> list[int]:
        bs, table = self.block_size, self.tables[row]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def reference(self, scale: float) -> torch.Tensor:
        return torch.cat([dense(q, k, v, scale) for q, k, v in zip(self.q, self.k, self.v)])

    def step(self, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Context]:
        """q, k, v of every row's new tokens and the Context of a step computing them (the
        first num_decodes rows are decodes), as ModelRunner.prepare_inputs builds it."""
        rows = self.rows
        q = torch.cat(self.q)
        k = torch.cat([k[c:] for k, (c, _) in zip(self.k, rows)])
        v = torch.cat([v[c:] for v, (c, _) in zip(self.v, rows)])
        slots = torch.tensor(sum((self.slots(i, c, c + n) for i, (c, n) in enumerate(rows)), []))
        ctx = Context(is_prefill=True, num_decodes=num_decodes, slot_mapping=slots,
                      block_tables=self.block_tables,
                      context_lens=torch.tensor([c + n for c, n in rows[:num_decodes]]),
                      seqlens_q=[n for _, n in rows], seqlens_k=[c + n for c, n in rows])
        return q, k, v, ctx


def check_kernel_against_dense(rows: list[tuple[int, int]], heads: int, kv_heads: int, dim: int,
                               block_size: int, dtype: torch.dtype, seed: int) -> None:
    """Every query of rows (num cached, num new) at once, against dense float64."""
    scale = dim ** -0.5
    b = Batch(rows, heads, kv_heads, dim, block_size, dtype, seed=seed)
    q = torch.cat(b.q)
    q_lens = torch.tensor([n for _, n in rows])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    k_lens = torch.tensor([c + n for c, n in rows])
    out = torch.full_like(q, float("nan"))
    cpu_paged.paged_attention(out, q, b.k_cache, b.v_cache, b.block_tables, q_starts, q_lens,
                              k_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), b.reference(scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 256, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_kernel_matches_dense_on_ragged_varlen_batch(dtype, block_size, heads, kv_heads, dim):
    # decodes over short and long contexts, chunks over cached prefixes (crossing the
    # kernel's 8-token query chunks and block boundaries), prompts with nothing cached.
    # Head dims 64 and 128 take the vectorised path on AVX-512 CPUs, 40 the generic one;
    # bf16 scores keys 8 at a time, so a block of 5 leaves every group of keys partial.
    rows = [(0, 1), (40, 1), (300, 1), (16, 13), (255, 9), (0, 21), (512, 32), (3, 2)]
    check_kernel_against_dense(rows, heads, kv_heads, dim, block_size, dtype,
                               seed=block_size + heads + dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("rows", [[(300, 1)], [(255, 9)], [(37, 1), (70, 1)]])
def test_kernel_matches_dense_with_one_kv_head_per_work_item(dtype, block_size, dim, rows):
    # With fewer (row, query chunk) items than 4 per thread (a single stream), each kv head
    # is a work item of its own; with more (the test above), an item covers all of them.
    check_kernel_against_dense(rows, 9, 3, dim, block_size, dtype, seed=dim + block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 256, 40])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 1), (6, 2)])
@pytest.mark.parametrize("row", [(300, 1), (255, 5), (37, 9)])
def test_a_row_split_across_threads_equals_it_in_a_batch(dtype, dim, heads, kv_heads, row):
    # Fewer kv heads than threads (Gemma 3 1B has one): a single stream's row is split, its
    # decode by query heads, its several tokens by chunks, so that every thread works. Each
    # query's result must be the one it gets in a batch (no split), bit for bit, and right.
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        b = Batch([row, (90, 1), (120, 3), (64, 1), (200, 1)], heads, kv_heads, dim, 16, dtype,
                  seed=dim + heads)
        q_lens = torch.tensor([n for _, n in b.rows])
        k_lens = torch.tensor([c + n for c, n in b.rows])
        batch = torch.full_like(torch.cat(b.q), float("nan"))
        cpu_paged.paged_attention(batch, torch.cat(b.q), b.k_cache, b.v_cache, b.block_tables,
                                  q_lens.cumsum(0) - q_lens, q_lens, k_lens, dim ** -0.5)
        alone = torch.full_like(b.q[0], float("nan"))
        cpu_paged.paged_attention(alone, b.q[0], b.k_cache, b.v_cache, b.block_tables[:1],
                                  torch.tensor([0]), q_lens[:1], k_lens[:1], dim ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batch[:row[1]])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.double(), dense(b.q[0], b.k[0], b.v[0], dim ** -0.5),
                               atol=tol, rtol=tol)


def attend(b: Batch, rows: list[int], threads: int, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """The kernel's output for the queries of b's rows `rows` (in that order), one call."""
    q = torch.cat([b.q[i] for i in rows])
    q_lens = torch.tensor([b.rows[i][1] for i in rows])
    k_lens = torch.tensor([sum(b.rows[i]) for i in rows])
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_paged.paged_attention(out, q, b.k_cache, b.v_cache, b.block_tables[rows],
                                  q_lens.cumsum(0) - q_lens, q_lens, k_lens,
                                  q.shape[-1] ** -0.5, window=window, softcap=softcap)
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("row", [(1000, 1), (700, 5), (250, 13), (509, 3), (300, 1)])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_row_cut_by_key_segments_equals_it_in_a_batch(dtype, dim, heads, kv_heads, row, threads):
    # Keys are attended in segments of 256 at fixed positions, folded in order. A single
    # stream's row is cut between the threads at segment edges (its kv heads' segments in
    # one run, a contiguous piece each), its partial results merged after; in a batch of
    # many rows one item folds all of a row's segments. Rows across one to four segments,
    # query chunks across a segment edge (250 + 13, 509 + 3), 3 kv heads on 2 threads (a
    # head cut in two) and 1 on 3. Each query's result must be the same bit for bit.
    b = Batch([row] + [(90 + 37 * i, 1 + i % 3) for i in range(11)], heads, kv_heads, dim, 16,
              dtype, seed=dim + heads + threads)
    alone = attend(b, [0], threads)
    batch = attend(b, list(range(len(b.rows))), threads)
    assert torch.equal(alone, batch[:row[1]])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.double(), dense(b.q[0], b.k[0], b.v[0], dim ** -0.5),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(16, None), (300, None), (600, 30.0), (None, 30.0)])
@pytest.mark.parametrize("row", [(1000, 1), (700, 5), (250, 13)])
def test_segments_with_a_window_or_soft_cap_equal_them_in_a_batch(dtype, window, softcap, row):
    # With a window the segments wholly before it are not read; a query whose window starts
    # inside a later segment than its chunk's first sees nothing in the earlier ones.
    b = Batch([row] + [(90 + 37 * i, 1 + i % 3) for i in range(11)], 9, 3, 64, 16, dtype,
              seed=(window or 0) + row[0])
    alone = attend(b, [0], 2, window, softcap)
    batch = attend(b, list(range(len(b.rows))), 2, window, softcap)
    assert torch.equal(alone, batch[:row[1]])
    assert not alone.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_q_in_place_from_a_wider_tensor(dtype):
    # In the engine q is a view into the qkv projection (rows wider than H * D): the kernel
    # must give exactly what it gives for a contiguous copy, into a contiguous out.
    rows = [(40, 1), (300, 1), (16, 13), (0, 21)]
    b = Batch(rows, 9, 3, 64, 16, dtype, seed=7)
    q = torch.cat(b.q)
    qkv = torch.cat([q.flatten(1), torch.randn(len(q), 6 * 64).to(dtype)], 1)
    q_view = qkv[:, :9 * 64].view(-1, 9, 64)
    assert not q_view.is_contiguous()
    q_lens = torch.tensor([n for _, n in rows])
    args = (b.k_cache, b.v_cache, b.block_tables, q_lens.cumsum(0) - q_lens, q_lens,
            torch.tensor([c + n for c, n in rows]), 0.125)
    from_view, from_copy = torch.empty_like(q), torch.empty_like(q)
    cpu_paged.paged_attention(from_view, q_view, *args)
    cpu_paged.paged_attention(from_copy, q.clone(), *args)
    assert torch.equal(from_view, from_copy)


@pytest.mark.parametrize("block_size", [16, 256])
def test_backend_decode_and_prefill_match_torch_native(block_size):
    """The backend's dispatch (decode kernel; prefill: flash, kernel or gather per row)
    gives torch_native's results through the same Context the ModelRunner builds."""
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    rows = [(0, 37), (32, 5), (256, 40), (16, 1)]
    b = Batch(rows, heads, kv_heads, dim, block_size, torch.float32, seed=7)
    q, k, v = torch.cat(b.q), torch.cat([k[c:] for k, (c, _) in zip(b.k, rows)]), \
        torch.cat([v[c:] for v, (c, _) in zip(b.v, rows)])
    slots = torch.tensor(sum((b.slots(i, c, c + n) for i, (c, n) in enumerate(rows)), []))
    ctx = Context(is_prefill=True, slot_mapping=slots, block_tables=b.block_tables,
                  seqlens_q=[n for _, n in rows], seqlens_k=[c + n for c, n in rows])
    ours = cpu_paged.attention(q, k, v, b.k_cache, b.v_cache, ctx, scale)
    ref = torch_native.attention(q, k, v, b.k_cache.clone(), b.v_cache.clone(), ctx, scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.double(), b.reference(scale), atol=1e-5, rtol=1e-5)

    decode_rows = [(c + n - 1, 1) for c, n in rows]
    d = Batch(decode_rows, heads, kv_heads, dim, block_size, torch.float32, seed=8)
    q = torch.cat(d.q)
    slots = torch.tensor([d.slots(i, c, c + 1)[0] for i, (c, _) in enumerate(decode_rows)])
    ctx = Context(is_prefill=False, slot_mapping=slots, block_tables=d.block_tables,
                  context_lens=torch.tensor([c + 1 for c, _ in decode_rows]))
    k = torch.stack([k[-1] for k in d.k])
    v = torch.stack([v[-1] for v in d.v])
    ours = cpu_paged.attention(q, k, v, d.k_cache, d.v_cache, ctx, scale)
    torch.testing.assert_close(ours.double(), d.reference(scale), atol=1e-5, rtol=1e-5)


def test_a_stale_build_lock_is_broken_not_waited_on(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = lock.stat().st_mtime - build.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    build.wait_for_other_builder(lock)  # returns instead of hanging
    assert not lock.exists()

@pytest.mark.parametrize("block_size", [16, 256])
def test_mixed_batch_decodes_then_chunks_match_torch_native(block_size):
    """A chunked-prefill step: decode rows first (the decode kernel), then a short chunk over
    a cached prefix (kernel), a long one (gather + SDPA) and a fresh prompt (flash), in one
    Context as ModelRunner.prepare_inputs builds it."""
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    rows = [(40, 1), (300, 1), (48, 16), (64, 64), (0, 24)]
    num_decodes = 2
    b = Batch(rows, heads, kv_heads, dim, block_size, torch.float32, seed=9)
    q, k, v, ctx = b.step(num_decodes)
    ours = cpu_paged.attention(q, k, v, b.k_cache, b.v_cache, ctx, scale)
    ref = torch_native.attention(q, k, v, b.k_cache.clone(), b.v_cache.clone(), ctx, scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.double(), b.reference(scale), atol=1e-5, rtol=1e-5)


@pytest.fixture
def cascade_on_small_batches(monkeypatch):
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_ROWS", 2)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_TOKENS", 32)


def prefix_blocks(plan: cpu_paged.KernelRows) -> list[list[int]]:
    return [p.blocks.tolist() for p in plan.prefixes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_cascade_over_a_shared_prefix_matches_dense(cascade_on_small_batches, dtype, dim):
    """Rows whose tables start with the same 5 blocks: decodes, then (mixed batch) chunks
    over the prefix plus a fresh prompt and a long chunk that do not take the kernel. The
    prefix is attended once for all kernel rows and merged with the rest by log-sum-exp."""
    heads, kv_heads, block_size, scale = 9, 3, 16, dim ** -0.5
    rows = [(80, 1), (100, 1), (170, 1), (81, 7), (0, 24), (96, 32), (90, 40)]
    num_decodes = 3
    b = Batch(rows, heads, kv_heads, dim, block_size, dtype, seed=11, shared_blocks=5)
    q, k, v, ctx = b.step(num_decodes)
    ours = cpu_paged.attention(q, k, v, b.k_cache, b.v_cache, ctx, scale)
    plans = ctx.backend_plans
    assert prefix_blocks(plans[("decode", 3)]) == [b.tables[0][:5]]
    assert plans[("prefill", 3)].rows == [3, 5]
    assert prefix_blocks(plans[("prefill", 3)]) == [b.tables[0][:5]]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), b.reference(scale), atol=tol, rtol=tol)
    # And without the cascade (below its thresholds), the same result.
    ctx.backend_plans.clear()
    cpu_paged.CASCADE_MIN_ROWS = 100
    plain = cpu_paged.attention(q, k, v, b.k_cache, b.v_cache, ctx, scale)
    assert not plans[("decode", 3)].prefixes
    torch.testing.assert_close(ours.double(), plain.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_with_two_prefix_groups_and_a_row_of_its_own(cascade_on_small_batches, dtype):
    """Decode rows in two groups (two system prompts, 4 blocks each) and one row sharing
    nothing: each group's prefix is attended once, the lone row takes the kernel alone."""
    heads, kv_heads, dim, block_size, scale = 9, 3, 64, 16, 0.125
    rows = [(70, 1), (90, 1), (100, 1), (64, 1), (130, 1), (75, 1)]
    groups = [0, 1, 0, None, 1, 0]
    b = Batch(rows, heads, kv_heads, dim, block_size, dtype, seed=13, shared_blocks=4,
              groups=groups)
    q, k, v, ctx = b.step(num_decodes=len(rows))
    ctx.is_prefill = False
    ours = cpu_paged.attention(q, k, v, b.k_cache, b.v_cache, ctx, scale)
    plan = ctx.backend_plans[("decode", len(rows))]
    assert sorted(prefix_blocks(plan)) == sorted([b.tables[0][:4], b.tables[1][:4]])
    assert plan.k_lens.tolist() == [7, 27, 37, 65, 67, 12]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), b.reference(scale), atol=tol, rtol=tol)


def test_cascade_takes_only_the_blocks_every_row_shares(cascade_on_small_batches):
    """Tables that agree on 3 blocks, then one row departs: the prefix is 3 blocks; a row
    whose new tokens start inside the shared blocks limits it to the blocks before them."""
    tables = torch.tensor([[7, 8, 9, 1, 2], [7, 8, 9, 4, 5], [7, 8, 9, 3, 6]])
    plan = cpu_paged.plan_kernel_rows([0, 1, 2], tables, [0, 1, 2], [1, 1, 1], [80, 80, 80], 16)
    assert prefix_blocks(plan) == [[7, 8, 9]]
    assert plan.tables.tolist() == [[1, 2, -1, -1, -1], [4, 5, -1, -1, -1], [3, 6, -1, -1, -1]]
    assert plan.k_lens.tolist() == [32, 32, 32]
    plan = cpu_paged.plan_kernel_rows([0, 1, 2], tables, [0, 1, 2], [1, 1, 1], [80, 80, 40], 16)
    assert prefix_blocks(plan) == [[7, 8]]
    plan = cpu_paged.plan_kernel_rows([0, 1, 2], tables, [0, 1, 2], [1, 1, 1], [80, 80, 20], 16)
    assert not plan.prefixes and plan.k_lens.tolist() == [80, 80, 20]
    other = torch.tensor([[7, 8, 9], [1, 8, 9]])
    assert not cpu_paged.plan_kernel_rows([0, 1], other, [0, 1], [1, 1], [48, 48], 16).prefixes


def test_adjacent_prefix_blocks_are_read_as_a_view_with_the_same_result():
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(12, 16, 3, 64, generator=gen)
    v_cache = torch.randn(12, 16, 3, 64, generator=gen)
    q = torch.randn(5, 9, 64, generator=gen)
    adjacent = cpu_paged.SharedPrefix(torch.tensor([4, 5, 6]), None)
    assert adjacent.cache_index == slice(4, 7)
    assert isinstance(cpu_paged.SharedPrefix(torch.tensor([4, 6, 5]), None).cache_index,
                      torch.Tensor)
    as_view = cpu_paged.prefix_attention(q, k_cache, v_cache, slice(4, 7), 0.125)
    as_copy = cpu_paged.prefix_attention(q, k_cache, v_cache, torch.tensor([4, 5, 6]), 0.125)
    for a, b in zip(as_view, as_copy):
        assert torch.equal(a, b)
    keys = k_cache[4:7].flatten(0, 1).double()   # [48, 3, 64]
    scores = torch.einsum("thd,khd->thk", q.double(), keys.repeat_interleave(3, 1)) * 0.125
    torch.testing.assert_close(as_view[1].double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
