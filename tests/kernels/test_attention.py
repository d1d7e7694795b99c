"""Paged attention (torch_native backend) against a dense causal attention reference, with
and without a sliding window and a soft-cap on the scores."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import torch_native
from pagedllm.attention.context import Context

H, HKV, D = 6, 2, 16
SCALE = D ** -0.5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [Lq, H, D] at positions q_start.., k/v [Lk, HKV, D] at 0..Lk-1; causal, GQA by
    repeat; a query at p sees keys p - window + 1 .. p; scores s -> cap * tanh(s / cap)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(q.shape[0])[:, None] + q_start
    kpos = torch.arange(k.shape[0])[None, :]
    hidden = (kpos > qpos) | ((kpos <= qpos - window) if window is not None else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def paged_layout(lengths: list[int], block_size: int, num_blocks: int, gen: torch.Generator):
    """Random, non-contiguous block tables for sequences of the given lengths."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lengths:
        need = -(-n // block_size)
        tables.append([perm.pop() for _ in range(need)])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    return tables, padded


def slots_for(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 2.0), (6, 2.0)],
                         ids=["plain", "window", "softcap", "window-softcap"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
def test_prefill_with_and_without_cached_prefix_and_decode_match_dense(block_size, window,
                                                                      softcap):
    gen = torch.Generator().manual_seed(block_size)
    lengths = [1, 5, 17, 33]          # total tokens per sequence
    cached = [0, 4, 16, 0]             # block-aligned prefix already in the cache (for bs=4/16)
    cached = [c if c % block_size == 0 else 0 for c in cached]
    num_blocks = sum(-(-n // block_size) for n in lengths) + len(lengths) + 2
    k_cache = torch.zeros(num_blocks, block_size, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    tables, padded = paged_layout(lengths, block_size, num_blocks, gen)
    ks = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
    vs = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
    qs = [torch.randn(n, H, D, generator=gen) for n in lengths]

    # The cached prefixes are in the cache before this step.
    for t, k, v, c in zip(tables, ks, vs, cached):
        slots = torch.tensor(slots_for(t, 0, c, block_size), dtype=torch.int64)
        torch_native.store_kvcache(k[:c], v[:c], k_cache, v_cache, slots)

    # Prefill of everything after the prefix, all sequences packed together.
    q = torch.cat([q[c:] for q, c in zip(qs, cached)])
    k = torch.cat([k[c:] for k, c in zip(ks, cached)])
    v = torch.cat([v[c:] for v, c in zip(vs, cached)])
    slots = torch.tensor(sum((slots_for(t, c, n, block_size)
                              for t, c, n in zip(tables, cached, lengths)), []))
    seqlens_q = [n - c for n, c in zip(lengths, cached)]
    ctx = Context(is_prefill=True, slot_mapping=slots, seqlens_q=seqlens_q, seqlens_k=lengths,
                  block_tables=padded if any(cached) else None)
    out = torch_native.attention(q, k, v, k_cache, v_cache, ctx, SCALE, window, softcap)
    start = 0
    for i, (n, c) in enumerate(zip(lengths, cached)):
        ref = dense_attention(qs[i][c:], ks[i], vs[i], c, window, softcap)
        torch.testing.assert_close(out[start:start + n - c], ref, atol=1e-5, rtol=1e-5)
        start += n - c

    # Decode of one more token per sequence through the block tables.
    new_lengths = [n + 1 for n in lengths]
    for t, n in zip(tables, new_lengths):
        if -(-n // block_size) > len(t):
            t.append(next(b for b in range(num_blocks) if all(b not in tt for tt in tables)))
    width = max(len(t) for t in tables)
    padded_new = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    if window is not None:  # blocks wholly out of the window are freed: never read
        for row, n in enumerate(new_lengths):
            padded_new[row, :max(0, n - window) // block_size] = -1
    qd = torch.randn(len(lengths), H, D, generator=gen)
    kd = torch.randn(len(lengths), HKV, D, generator=gen)
    vd = torch.randn(len(lengths), HKV, D, generator=gen)
    slots = torch.tensor([slots_for(t, n - 1, n, block_size)[0] for t, n in zip(tables, new_lengths)])
    ctx = Context(is_prefill=False, slot_mapping=slots, block_tables=padded_new,
                  context_lens=torch.tensor(new_lengths))
    out = torch_native.attention(qd, kd, vd, k_cache, v_cache, ctx, SCALE, window, softcap)
    for i, n in enumerate(lengths):
        k_all, v_all = torch.cat([ks[i], kd[i:i + 1]]), torch.cat([vs[i], vd[i:i + 1]])
        ref = dense_attention(qd[i:i + 1], k_all, v_all, n, window, softcap)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


def test_store_kvcache_writes_only_the_given_slots():
    k_cache = torch.zeros(4, 4, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.ones(2, HKV, D), 2 * torch.ones(2, HKV, D)
    torch_native.store_kvcache(k, v, k_cache, v_cache, torch.tensor([5, 14]))
    assert k_cache[1, 1].eq(1).all() and v_cache[3, 2].eq(2).all()
    assert k_cache.sum() == 2 * HKV * D
