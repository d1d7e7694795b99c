"""A bf16 KV cache under fp32 queries (kv_cache_dtype="bfloat16" for an fp32 model): the C++
kernels store fp32 K/V rounded to bf16 as torch rounds them, the paged-attention kernel reads
the bf16 cache with fp32 queries and matches dense float64 attention over the rounded K/V,
and the backends' Python paths (new tokens, gathered prefixes, windows, cascades) attend
over the same rounded values. Runs on any CPU the kernels build for (AVX2 or AVX-512)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedllm.attention import cpu_paged, torch_native
from pagedllm.kernels import build
from test_cpu_paged_attention import Batch  # tests/kernels (pytest's rootdir path)


@pytest.fixture(scope="module", autouse=True)
def kernel_builds():
    assert build.load() is not None, build.load_error


def bf16_batch(rows, heads, kv_heads, dim, block_size, seed, **kw) -> Batch:
    """Batch with fp32 queries and K/V, its caches (and its K/V, the reference's) rounded to
    bf16."""
    b = Batch(rows, heads, kv_heads, dim, block_size, torch.float32, seed=seed, **kw)
    b.k_cache, b.v_cache = b.k_cache.bfloat16(), b.v_cache.bfloat16()
    b.k = [k.bfloat16().float() for k in b.k]
    b.v = [v.bfloat16().float() for v in b.v]
    return b


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_kernel_reads_a_bf16_cache_with_fp32_queries(block_size, heads, kv_heads, dim):
    rows = [(0, 1), (37, 1), (16, 9), (70, 32), (3, 5), (255, 1)]
    b = bf16_batch(rows, heads, kv_heads, dim, block_size, seed=dim + heads)
    q = torch.cat(b.q)
    q_lens = torch.tensor([n for _, n in rows])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    k_lens = torch.tensor([c + n for c, n in rows])
    scale = dim ** -0.5
    out = torch.full_like(q, float("nan"))
    cpu_paged.paged_attention(out, q, b.k_cache, b.v_cache, b.block_tables, q_starts, q_lens,
                              k_lens, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), b.reference(scale), atol=1e-5, rtol=1e-5)
    # the fp32 kernel over the same values widened (on AVX-512 CPUs its own code: the same
    # sums in another order)
    wide = torch.full_like(q, float("nan"))
    cpu_paged.paged_attention(wide, q, b.k_cache.float(), b.v_cache.float(), b.block_tables,
                              q_starts, q_lens, k_lens, scale)
    torch.testing.assert_close(out, wide, atol=1e-5, rtol=1e-5)


def test_store_kv_rounds_fp32_rows_into_a_bf16_cache_as_torch_does():
    from pagedllm.kernels import ops
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(7, 3, 40, generator=gen) * 300 for _ in range(2))
    k[0, 0, 0] = 1 + 2 ** -8  # a tie: rounds to even
    slots = torch.tensor([5, -1, 0, 12, 3, 30, 31])
    caches = [torch.zeros(4, 8, 3, 40, dtype=torch.bfloat16) for _ in range(4)]
    ops.store_kv(k, v, caches[0], caches[1], slots)
    torch_native.store_kvcache(k[slots >= 0], v[slots >= 0], caches[2], caches[3],
                               slots[slots >= 0])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, 3, 40)
    assert torch.equal(flat[5], k[0].bfloat16()) and flat[5][0, 0].item() == 1.0
    assert not flat[1].any()  # nothing stored for slot -1
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.store_kv(k.bfloat16(), v.bfloat16(), caches[0].float(), caches[1].float(), slots)


@pytest.mark.parametrize("window", [None, 20])
def test_backends_attend_over_what_the_bf16_cache_holds(window):
    """cpu_paged.attention and torch_native.attention under fp32 queries with bf16 caches, in
    one step of decodes, short chunks (the kernel), long chunks over a cached prefix
    (gathered) and whole prompts (new tokens, rounded as stored): both equal dense float64
    attention over the rounded K/V."""
    heads, kv_heads, dim, scale = 8, 2, 64, 0.125
    rows = [(40, 1), (7, 1), (0, 37), (32, 5), (100, 40), (0, 3)]
    b = bf16_batch(rows, heads, kv_heads, dim, 16, seed=3)
    q, k, v, ctx = b.step(num_decodes=2)
    # the step's new K/V in fp32, unrounded (what the model's projection gives)
    gen = torch.Generator().manual_seed(4)
    k = k + torch.randn(k.shape, generator=gen) * 1e-3
    v = v + torch.randn(v.shape, generator=gen) * 1e-3
    at = 0
    for i, (c, n) in enumerate(rows):
        b.k[i][c:] = k[at:at + n].bfloat16().float()
        b.v[i][c:] = v[at:at + n].bfloat16().float()
        at += n
    results = []
    for backend in (cpu_paged, torch_native):
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        step = replace(ctx, backend_plans={})  # no plan the other backend left
        results.append(backend.attention(q, k, v, k_cache, v_cache, step, scale, window))
    if window is None:
        ref = b.reference(scale)
    else:
        ref = torch.cat([_windowed(qi, ki, vi, scale, window)
                         for qi, ki, vi in zip(b.q, b.k, b.v)])
    for out in results:
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              window: int) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill((kpos > qpos) | (kpos <= qpos - window), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

