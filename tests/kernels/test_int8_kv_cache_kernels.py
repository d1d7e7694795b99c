"""An int8 KV cache (kv_cache_dtype="int8"): each head vector as int8 values and an fp32
scale (attention/kv_quant.py). The C++ store quantizes by the same rule as the torch
reference, bit for bit; the paged-attention kernel (AVX-512 at head_dim 64/128/256, the
compiler-vectorised path at any other) over the int8 cache, with fp32 and bf16 queries,
matches dense float64 attention over the dequantized K/V; the backends' Python paths (new
tokens, gathered prefixes, windows, cascades) attend over the same dequantized values."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedllm.attention import cpu_paged, kv_quant, torch_native
from pagedllm.attention.context import Context
from pagedllm.kernels import build, ops
from test_cpu_paged_attention import Batch  # tests/kernels (pytest's rootdir path)


@pytest.fixture(scope="module", autouse=True)
def kernel_builds():
    assert build.load() is not None, build.load_error


def as_stored(x: torch.Tensor) -> torch.Tensor:
    """x's vectors as an int8 cache gives them back (fp32: exact for the float64 reference)."""
    return kv_quant.dequantize(kv_quant.quantize(x), torch.float32)


def int8_batch(rows, heads, kv_heads, dim, block_size, seed, dtype=torch.float32,
               **kw) -> Batch:
    """Batch whose caches are int8, every unused slot garbage (random values, scale 1e3: a
    read shows; finite, as torch's path reads masked slots), its K/V (the reference's) as
    stored."""
    b = Batch(rows, heads, kv_heads, dim, block_size, dtype, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (*b.k_cache.shape[:3], dim + kv_quant.SCALE_BYTES)
    b.k_cache, b.v_cache = (torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
                            for _ in range(2))
    for cache in (b.k_cache, b.v_cache):
        cache[..., dim:] = torch.tensor([1e3]).view(torch.int8)
    for i, (c, n) in enumerate(rows):
        torch_native.store_kvcache(b.k[i], b.v[i], b.k_cache, b.v_cache,
                                   torch.tensor(b.slots(i, 0, c + n)))
    b.k = [as_stored(k) for k in b.k]
    b.v = [as_stored(v) for v in b.v]
    return b


def test_quantize_rule():
    x = torch.tensor([[0.5, -1.0, 0.25, 127 / 254], [0.0, 0.0, 0.0, 0.0], [3.0, -3.0, 1e-3, 0.0]])
    q = kv_quant.quantize(x)
    assert q.shape == (3, 8) and q.dtype == torch.int8
    assert q[0, :4].tolist() == [64, -127, 32, 64]  # 63.5 -> 64 (to even), 31.75 -> 32
    assert kv_quant.scales(q).flatten().tolist() == pytest.approx([1 / 127, 0.0, 3 / 127])
    assert not q[1].any()  # zeros: scale 0, values 0
    back = kv_quant.dequantize(q, torch.float32)
    assert back.shape == x.shape and back[1].eq(0).all()
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(50, 4, 128, generator=gen) * torch.rand(50, 4, 1, generator=gen) * 100
    err = (kv_quant.dequantize(kv_quant.quantize(y), torch.float32) - y).abs()
    bound = y.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5)
    assert (err <= bound).all()  # at most half a step of max |x| / 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantizes_as_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(7, 3, 64, generator=gen).mul(30).to(dtype) for _ in range(2))
    k[2] = 0  # a vector of zeros
    k[3, 0, :] = torch.arange(64, dtype=dtype) - 32  # x / scale at exact halves
    slots = torch.tensor([5, -1, 0, 12, 3, 30, 31])
    caches = [torch.full((4, 8, 3, 68), 7, dtype=torch.int8) for _ in range(4)]
    ops.store_kv(k, v, caches[0], caches[1], slots)
    keep = slots >= 0
    torch_native.store_kvcache(k[keep], v[keep], caches[2], caches[3], slots[keep])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, 3, 68)
    assert torch.equal(flat[5], kv_quant.quantize(k[0]))
    assert (flat[1] == 7).all()  # nothing stored for slot -1
    with pytest.raises(RuntimeError, match="D \\+ 4"):
        ops.store_kv(k, v, caches[0][..., :64], caches[1][..., :64], slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (16, 8)])
@pytest.mark.parametrize("dim", [64, 128, 256, 40])
def test_kernel_reads_an_int8_cache(dtype, block_size, heads, kv_heads, dim):
    rows = [(0, 1), (37, 1), (16, 9), (70, 32), (3, 5), (600, 1)]
    b = int8_batch(rows, heads, kv_heads, dim, block_size, seed=dim + heads, dtype=dtype)
    q = torch.cat(b.q)
    q_lens = torch.tensor([n for _, n in rows])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    k_lens = torch.tensor([c + n for c, n in rows])
    scale = dim ** -0.5
    out = torch.full_like(q, float("nan"))
    cpu_paged.paged_attention(out, q, b.k_cache, b.v_cache, b.block_tables, q_starts, q_lens,
                              k_lens, scale)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), b.reference(scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0), (9, 3.0)])
@pytest.mark.parametrize("dim", [64, 40])
def test_kernel_int8_window_and_softcap(window, softcap, dim):
    """One row per call: a decode past the window (blocks before it freed: -1), a verify
    step's rows, a chunk."""
    heads, kv_heads = 8, 2
    for rows in ([(300, 1)], [(61, 5)], [(40, 24)]):
        b = int8_batch(rows, heads, kv_heads, dim, 16, seed=7)
        if window is not None:  # blocks wholly before the first query's window: freed
            c, n = rows[0]
            first = max(0, c - window + 1) // 16
            b.block_tables[0, :first] = -1
        q = torch.cat(b.q)
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, b.k_cache, b.v_cache, b.block_tables, torch.tensor([0]),
                            torch.tensor([rows[0][1]]), torch.tensor([sum(rows[0])]), 0.2,
                            None, None, window or 0, softcap or 0.0)
        ref = _attend64(b.q[0], b.k[0], b.v[0], 0.2, window, softcap)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_backends_attend_over_what_the_int8_cache_holds(window):
    """cpu_paged.attention and torch_native.attention with int8 caches, in one step of
    decodes, short chunks (the kernel), long chunks over a cached prefix (gathered) and
    whole prompts (new tokens, rounded as stored): both equal dense float64 attention over
    the dequantized K/V."""
    heads, kv_heads, dim, scale = 8, 2, 64, 0.125
    rows = [(40, 1), (7, 1), (0, 37), (32, 5), (100, 40), (0, 3)]
    b = int8_batch(rows, heads, kv_heads, dim, 16, seed=3)
    q, k, v, ctx = b.step(num_decodes=2)
    gen = torch.Generator().manual_seed(4)  # the step's new K/V, not yet quantized
    k = k + torch.randn(k.shape, generator=gen) * 1e-2
    v = v + torch.randn(v.shape, generator=gen) * 1e-2
    at = 0
    for i, (c, n) in enumerate(rows):
        b.k[i][c:] = as_stored(k[at:at + n])
        b.v[i][c:] = as_stored(v[at:at + n])
        at += n
    results = []
    for backend in (cpu_paged, torch_native):
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        step = replace(ctx, backend_plans={})  # no plan the other backend left
        results.append(backend.attention(q, k, v, k_cache, v_cache, step, scale, window))
    ref = torch.cat([_attend64(qi, ki, vi, scale, window, None)
                     for qi, ki, vi in zip(b.q, b.k, b.v)])
    for out in results:
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_cascade_prefix_over_an_int8_cache():
    """Rows sharing a cached prefix take cascade attention: the prefix part reads the int8
    blocks dequantized, the rest the kernel; equal to dense attention."""
    heads, kv_heads, dim, scale = 8, 2, 64, 0.125
    rows = [(300, 1)] * 6
    b = int8_batch(rows, heads, kv_heads, dim, 16, seed=11, shared_blocks=16)
    q, k, v, ctx = b.step(num_decodes=6)
    ctx = Context(is_prefill=False, slot_mapping=ctx.slot_mapping, block_tables=ctx.block_tables,
                  context_lens=ctx.context_lens)
    plan = cpu_paged.decode_plan(ctx, len(rows), 16)
    assert plan.prefixes, "the rows share 16 blocks: a cascade"
    out = cpu_paged.attention(q, k.float(), v.float(), b.k_cache, b.v_cache, ctx, scale)
    # the new tokens were stored again by attention(): the reference reads them as stored
    for i in range(len(rows)):
        b.k[i][-1:] = as_stored(k[i:i + 1])
        b.v[i][-1:] = as_stored(v[i:i + 1])
    torch.testing.assert_close(out.double(), b.reference(scale), atol=1e-5, rtol=1e-5)


def _attend64(q, k, v, scale, window, softcap):
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
    kpos = torch.arange(k.shape[0])[None, :]
    hide = kpos > qpos
    if window is not None:
        hide |= kpos <= qpos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hide, float("-inf")).softmax(-1), v)
