"""The Triton attention kernels compiled for the real GPU, against a float64 dense reference
computed on the device: fp32, bf16 and fp16; GQA groups 1-8; head_dim 64/128/256; mixed
decode + chunk + prompt batches; sliding window and soft-cap; block sizes 16 and 256;
padded CUDA-graph rows and capture/replay. Relative error ||out - ref|| / ||ref||: fp32
< 1e-5, fp16 / bf16 < 1e-2.

Run in its own pytest process: tests/kernels sets TRITON_INTERPRET=1 at import, which
would turn these kernels into the CPU interpreter.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process (tests/kernels sets it): run tests/gpu "
                "in its own pytest process", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Triton kernels are tested in the interpreter by "
                "tests/kernels/test_triton_attention.py", allow_module_level=True)

from pagedllm.attention import triton_backend  # noqa: E402
from pagedllm.attention.context import Context  # noqa: E402

DEV = torch.device("cuda")
MAX_REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


class Case:
    """A step over random sequences: row i has lens_k[i] tokens, the last lens_q[i] new.
    The cached prefixes are written into shuffled cache blocks; full_k/full_v keep every
    row's keys and values (as the dtype rounds them) for the reference."""

    def __init__(self, dtype: torch.dtype, h: int, hkv: int, d: int, block_size: int,
                 lens_k: list[int], lens_q: list[int], seed: int, extra_columns: int = 0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.dtype, self.h, self.hkv, self.d, self.bs = dtype, h, hkv, d, block_size
        self.lens_k, self.lens_q = lens_k, lens_q
        counts = [-(-n // block_size) for n in lens_k]
        num_blocks = sum(counts) + 4
        self.k_cache = torch.randn(num_blocks, block_size, hkv, d, device=DEV, generator=gen,
                                   dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)   # other blocks hold garbage
        perm = torch.randperm(num_blocks, device=DEV, generator=gen).tolist()
        width = max(counts) + extra_columns
        rows = [[perm.pop() for _ in range(c)] for c in counts]
        self.tables = torch.tensor([r + [-1] * (width - len(r)) for r in rows], device=DEV)
        self.full_k = [torch.randn(n, hkv, d, device=DEV, generator=gen, dtype=dtype)
                       for n in lens_k]
        self.full_v = [torch.randn(n, hkv, d, device=DEV, generator=gen, dtype=dtype)
                       for n in lens_k]
        self.q = torch.randn(sum(lens_q), h, d, device=DEV, generator=gen, dtype=dtype)
        self.k = torch.cat([fk[n - m:] for fk, n, m in zip(self.full_k, lens_k, lens_q)])
        self.v = torch.cat([fv[n - m:] for fv, n, m in zip(self.full_v, lens_k, lens_q)])
        for i, (n, m) in enumerate(zip(lens_k, lens_q)):
            prefix = self.slots(i, 0, n - m)
            self.k_cache.view(-1, hkv, d)[prefix] = self.full_k[i][:n - m]
            self.v_cache.view(-1, hkv, d)[prefix] = self.full_v[i][:n - m]
        self.slot_mapping = torch.cat([self.slots(i, n - m, n)
                                       for i, (n, m) in enumerate(zip(lens_k, lens_q))])

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, device=DEV)
        return self.tables[i, pos // self.bs] * self.bs + pos % self.bs

    def context(self) -> Context:
        d = next((i for i, m in enumerate(self.lens_q) if m != 1), len(self.lens_q))
        lens_q, lens_k = torch.tensor(self.lens_q), torch.tensor(self.lens_k)
        return Context(is_prefill=d < len(self.lens_q), num_decodes=d,
                       cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int64),
                                               lens_q.cumsum(0)]).to(DEV),
                       cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int64),
                                               lens_k.cumsum(0)]).to(DEV),
                       max_seqlen_q=max(self.lens_q), max_seqlen_k=max(self.lens_k),
                       slot_mapping=self.slot_mapping, context_lens=lens_k[:d].to(DEV),
                       block_tables=self.tables, seqlens_q=self.lens_q, seqlens_k=self.lens_k)

    def reference(self, scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """Dense float64 attention of every row's new tokens over its keys."""
        out, start, group = [], 0, self.h // self.hkv
        for fk, fv, n, m in zip(self.full_k, self.full_v, self.lens_k, self.lens_q):
            q = self.q[start:start + m].double()
            k = fk.double().repeat_interleave(group, 1)
            v = fv.double().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            q_pos = torch.arange(n - m, n, device=DEV)[:, None]
            k_pos = torch.arange(n, device=DEV)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            s = s.masked_fill(~visible, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
            start += m
        return torch.cat(out)

    def run(self, scale: float, **options) -> torch.Tensor:
        return triton_backend.attention(self.q, self.k, self.v, self.k_cache, self.v_cache,
                                        self.context(), scale, **options)


# decode rows (one new token), a speculative-verify-like row, a chunk after a cached
# prefix, a fresh prompt
MIXED = dict(lens_k=[1, 700, 260, 1100, 517], lens_q=[1, 1, 5, 300, 517])
DECODE = dict(lens_k=[1, 255, 256, 257, 1500, 3000], lens_q=[1] * 6)
SHAPES = [  # (dtype, heads, kv heads, head_dim)
    (torch.float32, 16, 8, 128), (torch.float32, 8, 1, 256),
    (torch.bfloat16, 16, 8, 128), (torch.bfloat16, 8, 1, 64), (torch.bfloat16, 8, 4, 256),
    (torch.float16, 16, 8, 128),
]


@pytest.mark.parametrize("dtype,h,hkv,d", SHAPES, ids=lambda x: str(x).replace("torch.", ""))
def test_mixed_batch_and_decode_match_float64(dtype, h, hkv, d):
    for seed, lens in enumerate((MIXED, DECODE)):
        case = Case(dtype, h, hkv, d, 16, seed=seed, **lens)
        out = case.run(d ** -0.5)
        assert not out.isnan().any()
        assert rel_error(out, case.reference(d ** -0.5)) < MAX_REL[dtype]
        stored = case.k_cache.view(-1, hkv, d)[case.slot_mapping]
        assert torch.equal(stored, case.k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_window_and_softcap_match_float64(dtype):
    scale, options = 128 ** -0.5, dict(window=200, softcap=5.0)
    for seed, lens in enumerate((MIXED, DECODE)):
        case = Case(dtype, 8, 2, 128, 16, seed=10 + seed, **lens)
        # free (-1) every block wholly before each row's first query's window
        for i, (n, m) in enumerate(zip(case.lens_k, case.lens_q)):
            case.tables[i, :max(n - m - 200 + 1, 0) // 16] = -1
        out = case.run(scale, **options)
        assert not out.isnan().any()
        assert rel_error(out, case.reference(scale, **options)) < MAX_REL[dtype]


def test_block_size_256():
    for seed, lens in enumerate((MIXED, DECODE)):
        case = Case(torch.bfloat16, 16, 8, 128, 256, seed=20 + seed, **lens)
        assert rel_error(case.run(128 ** -0.5), case.reference(128 ** -0.5)) < 1e-2


def test_decode_replays_in_a_cuda_graph_with_padded_rows_and_wide_tables():
    """As engine/cuda_graph.py runs it: static buffers of 8 rows and 200 table columns; 5
    real rows, the rest with context 0 and slot -1. The replay must equal the eager call on
    the unpadded inputs bit for bit, and give zeros on the padded rows."""
    dtype, h, hkv, d, scale = torch.bfloat16, 16, 8, 128, 128 ** -0.5
    case = Case(dtype, h, hkv, d, 16, lens_k=[1, 300, 17, 1500, 900], lens_q=[1] * 5, seed=30)
    eager = case.run(scale)      # stores the new tokens' K/V too
    n, rows, cols = 5, 8, 200
    q = torch.zeros(rows, h, d, device=DEV, dtype=dtype)
    context_lens = torch.zeros(rows, dtype=torch.int64, device=DEV)
    tables = torch.zeros(rows, cols, dtype=torch.int64, device=DEV)
    ctx = Context(is_prefill=False, slot_mapping=torch.full((rows,), -1, device=DEV),
                  context_lens=context_lens, block_tables=tables)
    out = triton_backend.decode_attention(q, case.k_cache, case.v_cache, ctx, scale)  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_backend.decode_attention(q, case.k_cache, case.v_cache, ctx, scale)
    q[:n] = case.q
    context_lens[:n] = torch.tensor(case.lens_k, device=DEV)
    tables[:n, :case.tables.shape[1]] = case.tables
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:n], eager)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_store_kvcache_skips_padding_slots():
    k_cache = torch.zeros(4, 16, 2, 64, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 64, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    triton_backend.store_kvcache(k, v, k_cache, v_cache,
                                 torch.tensor([5, -1, 40], device=DEV))
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[40], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[40], v[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2
