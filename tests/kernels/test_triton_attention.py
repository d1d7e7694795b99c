"""The Triton kernels, run by the Triton interpreter on CPU tensors, against the PyTorch
backend: random block tables, GQA, ragged lengths, cached prefixes, block sizes 16 and 256.
(The GPU compilation of these kernels is not exercised on this CPU-only machine.)"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run in numpy

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.attention import torch_native  # noqa: E402
from pagedllm.attention import triton_backend  # noqa: E402
from pagedllm.attention.context import Context  # noqa: E402
from pagedllm.attention.dispatch import resolve_backend  # noqa: E402

H, HKV, D = 4, 2, 32
SCALE = D ** -0.5


def random_tables(lengths: list[int], block_size: int, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    """Non-contiguous, shuffled physical blocks per sequence, -1 padded."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables])


def slots(table: torch.Tensor, start: int, end: int, block_size: int) -> list[int]:
    return [int(table[p // block_size]) * block_size + p % block_size for p in range(start, end)]


def make_step(block_size: int, lengths: list[int], cached: list[int], seed: int):
    """Caches holding each sequence's cached prefix, and a packed prefill of the rest."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(n + 1) // block_size) for n in lengths) + 3
    k_cache = torch.randn(num_blocks, block_size, HKV, D, generator=gen)  # garbage elsewhere
    v_cache = torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    tables = random_tables([n + 1 for n in lengths], block_size, num_blocks, gen)
    for i, c in enumerate(cached):
        idx = torch.tensor(slots(tables[i], 0, c, block_size), dtype=torch.int64)
        torch_native.store_kvcache(torch.randn(c, HKV, D, generator=gen),
                                   torch.randn(c, HKV, D, generator=gen), k_cache, v_cache, idx)
    seqlens_q = [n - c for n, c in zip(lengths, cached)]
    t = sum(seqlens_q)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (H, HKV, HKV))
    slot_mapping = torch.tensor(sum((slots(tables[i], c, n, block_size)
                                     for i, (n, c) in enumerate(zip(lengths, cached))), []))
    ctx = Context(is_prefill=True,
                  cu_seqlens_q=torch.tensor([0] + seqlens_q).cumsum(0),
                  cu_seqlens_k=torch.tensor([0] + lengths).cumsum(0),
                  max_seqlen_q=max(seqlens_q), max_seqlen_k=max(lengths),
                  slot_mapping=slot_mapping, block_tables=tables if any(cached) else None,
                  seqlens_q=seqlens_q, seqlens_k=lengths)
    return q, k, v, k_cache, v_cache, ctx, tables


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_triton_prefill_and_decode_match_torch_backend(block_size, with_prefix):
    # Kept small: the interpreter runs every program instance in numpy.
    lengths = [1, 7, 40, 19, 270] if with_prefix else [1, 7, 40, 19, 50]
    cached = [0, 0, 32, 16, 256] if with_prefix else [0] * len(lengths)
    cached = [c if c % block_size == 0 else 0 for c in cached]
    q, k, v, k_cache, v_cache, ctx, tables = make_step(block_size, lengths, cached,
                                                       seed=block_size + with_prefix)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = torch_native.attention(q, k, v, kc_ref, vc_ref, ctx, SCALE)
    out = triton_backend.attention(q, k, v, k_cache, v_cache, ctx, SCALE)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)  # same slots written
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)

    # One decode step: a new token per sequence, attending through the block tables.
    gen = torch.Generator().manual_seed(7)
    q1, k1, v1 = (torch.randn(len(lengths), h, D, generator=gen) for h in (H, HKV, HKV))
    slot_mapping = torch.tensor([slots(tables[i], n, n + 1, block_size)[0]
                                 for i, n in enumerate(lengths)])
    dctx = Context(is_prefill=False, slot_mapping=slot_mapping, block_tables=tables,
                   context_lens=torch.tensor(lengths) + 1)
    ref = torch_native.attention(q1, k1, v1, kc_ref, vc_ref, dctx, SCALE)
    out = triton_backend.attention(q1, k1, v1, k_cache, v_cache, dctx, SCALE)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_store_kvcache_skips_padding_slots():
    k_cache = torch.zeros(4, 16, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    triton_backend.store_kvcache(k, v, k_cache, v_cache, torch.tensor([5, -1, 40]))
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[40], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[40], v[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2   # nothing else was written


def test_dispatch_names_what_a_backend_lacks():
    with pytest.raises(ValueError, match="power-of-two block_size >= 16"):
        resolve_backend("triton", "cpu", 8, torch.float32)
    with pytest.raises(ValueError, match="device='cuda'.*multiple of 256.*float16"):
        resolve_backend("flash", "cpu", 16, torch.float32)
    with pytest.raises(ValueError, match="cpu_paged kernel is CPU-only"):
        resolve_backend("cpu_paged", "cuda", 16, torch.float32)
    # The C++ kernel on CPU (torch_native only if it cannot be built).
    assert resolve_backend("auto", "cpu", 16, torch.float32) == "cpu_paged"
    assert resolve_backend("torch", "cpu", 16, torch.float32) == "torch"
    assert resolve_backend("triton", "cpu", 16, torch.float32) == "triton"  # interpreter
