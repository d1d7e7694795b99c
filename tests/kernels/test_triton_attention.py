"""The Triton kernels, run by the Triton interpreter on CPU tensors, against the PyTorch
backend in float64: random block tables, GQA groups 1-8, head sizes 64-256 (and 80),
ragged lengths, cached prefixes, mixed decode + prefill batches, sliding windows,
soft-caps, padded CUDA-graph rows, block sizes 16 and 256; and the kernels compile for
sm_90 / sm_80 (ahead of time: no GPU needed)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run in numpy

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedllm.attention import torch_native  # noqa: E402
from pagedllm.attention import triton_backend  # noqa: E402
from pagedllm.attention.context import Context  # noqa: E402
from pagedllm.attention.dispatch import resolve_backend  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
H, HKV, D = 4, 2, 32
SCALE = D ** -0.5
# fp32 kernels against a float64 reference
TOL = dict(atol=2e-5, rtol=1e-5)


def random_tables(lengths: list[int], block_size: int, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    """Non-contiguous, shuffled physical blocks per sequence, -1 padded."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables])


def slots(table: torch.Tensor, start: int, end: int, block_size: int) -> list[int]:
    return [int(table[p // block_size]) * block_size + p % block_size for p in range(start, end)]


def float64_reference(q, k, v, k_cache, v_cache, ctx, scale, **options) -> torch.Tensor:
    """torch_native in float64 on copies (the caches get the new tokens too)."""
    q, k, v, kc, vc = (t.double() for t in (q, k, v, k_cache, v_cache))
    return torch_native.attention(q, k, v, kc, vc, ctx, scale, **options)


def make_step(block_size: int, lengths: list[int], cached: list[int], seed: int,
              h: int = H, hkv: int = HKV, d: int = D, num_decodes: int = 0):
    """Caches holding each sequence's cached prefix, and a packed step computing the rest
    (rows with one new token first when num_decodes > 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(n + 1) // block_size) for n in lengths) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)  # garbage elsewhere
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    tables = random_tables([n + 1 for n in lengths], block_size, num_blocks, gen)
    for i, c in enumerate(cached):
        idx = torch.tensor(slots(tables[i], 0, c, block_size), dtype=torch.int64)
        torch_native.store_kvcache(torch.randn(c, hkv, d, generator=gen),
                                   torch.randn(c, hkv, d, generator=gen), k_cache, v_cache, idx)
    seqlens_q = [n - c for n, c in zip(lengths, cached)]
    t = sum(seqlens_q)
    q, k, v = (torch.randn(t, heads, d, generator=gen) for heads in (h, hkv, hkv))
    slot_mapping = torch.tensor(sum((slots(tables[i], c, n, block_size)
                                     for i, (n, c) in enumerate(zip(lengths, cached))), []))
    ctx = Context(is_prefill=num_decodes < len(lengths), num_decodes=num_decodes,
                  cu_seqlens_q=torch.tensor([0] + seqlens_q).cumsum(0),
                  cu_seqlens_k=torch.tensor([0] + lengths).cumsum(0),
                  max_seqlen_q=max(seqlens_q), max_seqlen_k=max(lengths),
                  slot_mapping=slot_mapping,
                  context_lens=torch.tensor(lengths[:num_decodes]),
                  block_tables=tables if any(cached) else None,
                  seqlens_q=seqlens_q, seqlens_k=lengths)
    return q, k, v, k_cache, v_cache, ctx, tables


def decode_step(tables: torch.Tensor, lengths: list[int], block_size: int, h: int, hkv: int,
                d: int, seed: int):
    """One decode step: a new token per sequence at position lengths[i]."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(lengths), heads, d, generator=gen) for heads in (h, hkv, hkv))
    slot_mapping = torch.tensor([slots(tables[i], n, n + 1, block_size)[0]
                                 for i, n in enumerate(lengths)])
    ctx = Context(is_prefill=False, slot_mapping=slot_mapping, block_tables=tables,
                  context_lens=torch.tensor(lengths) + 1)
    return q, k, v, ctx


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_triton_prefill_and_decode_match_float64_reference(block_size, with_prefix):
    # Kept small: the interpreter runs every program instance in numpy.
    lengths = [1, 7, 40, 19, 270] if with_prefix else [1, 7, 40, 19, 150]
    cached = [0, 0, 32, 16, 256] if with_prefix else [0] * len(lengths)
    cached = [c if c % block_size == 0 else 0 for c in cached]
    q, k, v, k_cache, v_cache, ctx, tables = make_step(block_size, lengths, cached,
                                                       seed=block_size + with_prefix)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = float64_reference(q, k, v, kc_ref, vc_ref, ctx, SCALE)
    torch_native.store_kvcache(k, v, kc_ref, vc_ref, ctx.slot_mapping)
    out = triton_backend.attention(q, k, v, k_cache, v_cache, ctx, SCALE)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)  # same slots written
    torch.testing.assert_close(out.double(), ref, **TOL)

    q1, k1, v1, dctx = decode_step(tables, lengths, block_size, H, HKV, D, seed=7)
    ref = float64_reference(q1, k1, v1, kc_ref, vc_ref, dctx, SCALE)
    torch_native.store_kvcache(k1, v1, kc_ref, vc_ref, dctx.slot_mapping)
    out = triton_backend.attention(q1, k1, v1, k_cache, v_cache, dctx, SCALE)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    torch.testing.assert_close(out.double(), ref, **TOL)


def test_mixed_batch_decode_rows_chunk_and_fresh_prompt():
    # two decode rows, a 20-token chunk after 32 cached tokens, a fresh 70-token prompt
    lengths, cached = [41, 18, 52, 70], [40, 17, 32, 0]
    q, k, v, k_cache, v_cache, ctx, _ = make_step(16, lengths, cached, seed=3, h=8, hkv=2,
                                                  d=64, num_decodes=2)
    ref = float64_reference(q, k, v, k_cache, v_cache, ctx, 64 ** -0.5)
    out = triton_backend.attention(q, k, v, k_cache, v_cache, ctx, 64 ** -0.5)
    torch.testing.assert_close(out.double(), ref, **TOL)


@pytest.mark.parametrize("h,hkv,d,block_size", [
    (4, 4, 64, 16),     # group 1
    (8, 4, 128, 256),   # group 2, big blocks
    (8, 2, 64, 16),     # group 4
    (8, 1, 256, 16),    # group 8, head_dim 256 (512-token splits)
    (6, 2, 80, 16),     # group 3, head_dim 80 (masked to 128)
])
def test_decode_gqa_groups_and_head_dims_over_several_splits(h, hkv, d, block_size):
    lengths = [0, 16, 300, 600]   # ragged, across splits of 256 / 512 tokens
    gen = torch.Generator().manual_seed(h * d + hkv)
    num_blocks = sum(-(-(n + 1) // block_size) for n in lengths) + 2
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    tables = random_tables([n + 1 for n in lengths], block_size, num_blocks, gen)
    q, k, v, ctx = decode_step(tables, lengths, block_size, h, hkv, d, seed=d)
    ref = float64_reference(q, k, v, k_cache, v_cache, ctx, d ** -0.5)
    out = triton_backend.attention(q, k, v, k_cache, v_cache, ctx, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, **TOL)


def free_blocks_before_window(tables: torch.Tensor, first_visible: list[int], block_size: int,
                              poison_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables whose blocks wholly before each row's window are -1, and tables pointing them
    at a block of NaNs instead (a kernel that reads one gives NaN)."""
    freed, poisoned = tables.clone(), tables.clone()
    for i, first in enumerate(first_visible):
        dead = max(first, 0) // block_size
        freed[i, :dead] = -1
        poisoned[i, :dead] = poison_block
    return freed, poisoned


@pytest.mark.parametrize("window,softcap", [(24, None), (None, 5.0), (100, 5.0)])
def test_window_and_softcap_match_float64_reference(window, softcap):
    h, hkv, d, bs = 4, 2, 64, 16
    scale, options = d ** -0.5, dict(window=window, softcap=softcap)
    lengths, cached = [1, 40, 200, 330], [0, 32, 160, 0]   # chunks after a prefix, prompts
    q, k, v, k_cache, v_cache, ctx, tables = make_step(bs, lengths, cached, seed=11, h=h,
                                                       hkv=hkv, d=d)
    poison = min(set(range(k_cache.shape[0])) - set(tables.flatten().tolist()))  # a spare
    k_cache[poison] = v_cache[poison] = float("nan")
    if window is not None:  # a row's first query sits at position cached[i]
        freed, poisoned = free_blocks_before_window(
            tables, [c - window + 1 for c in cached], bs, poison)
    else:
        freed = poisoned = tables
    ref = float64_reference(q, k, v, k_cache, v_cache,
                            Context(**{**ctx.__dict__, "block_tables": freed}), scale, **options)
    for table in ([freed] if window is None else [freed, poisoned]):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = triton_backend.attention(q, k, v, kc, vc,
                                       Context(**{**ctx.__dict__, "block_tables": table}),
                                       scale, **options)
        torch.testing.assert_close(out.double(), ref, **TOL)

    # decode: the next token of each sequence
    torch_native.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    q1, k1, v1, dctx = decode_step(tables, lengths, bs, h, hkv, d, seed=12)
    if window is not None:
        freed, poisoned = free_blocks_before_window(
            tables, [n + 1 - window for n in lengths], bs, poison)
    ref = float64_reference(q1, k1, v1, k_cache, v_cache,
                            Context(**{**dctx.__dict__, "block_tables": freed}), scale, **options)
    for table in ([freed] if window is None else [freed, poisoned]):
        out = triton_backend.attention(q1, k1, v1, k_cache.clone(), v_cache.clone(),
                                       Context(**{**dctx.__dict__, "block_tables": table}),
                                       scale, **options)
        torch.testing.assert_close(out.double(), ref, **TOL)


def test_decode_padded_graph_rows_give_zeros_and_store_nothing():
    h, hkv, d, bs = 4, 2, 64, 16
    lengths = [33, 0, 0]                # rows 1, 2: a CUDA graph's padding
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(6, bs, hkv, d, generator=gen)
    v_cache = torch.randn(6, bs, hkv, d, generator=gen)
    tables = torch.tensor([[2, 4, 1], [0, 0, 0], [-1, -1, -1]])  # padding: zeros or -1
    q, k, v = (torch.randn(3, heads, d, generator=gen) for heads in (h, hkv, hkv))
    ctx = Context(is_prefill=False, slot_mapping=torch.tensor([1 * bs, -1, -1]),
                  block_tables=tables, context_lens=torch.tensor(lengths))
    kc, vc = k_cache.clone(), v_cache.clone()
    out = triton_backend.attention(q, k, v, kc, vc, ctx, d ** -0.5)
    assert not out.isnan().any()
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    changed = (kc != k_cache).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [1] and torch.equal(kc[1, 0], k[0]) and torch.equal(vc[1, 0], v[0])
    first = Context(is_prefill=False, slot_mapping=ctx.slot_mapping[:1],
                    block_tables=tables[:1], context_lens=ctx.context_lens[:1])
    torch.testing.assert_close(out[:1].double(),
                               float64_reference(q[:1], k[:1], v[:1], k_cache, v_cache, first,
                                                 d ** -0.5), **TOL)


@pytest.mark.parametrize("window", [None, 40])
def test_decode_is_bit_identical_whatever_the_block_table_width(window):
    # A CUDA graph pads the tables to max_blocks_per_seq with -1: 40 more columns of 16
    # tokens add two empty 256-token splits, which must not change a single bit.
    h, hkv, d, bs = 8, 2, 64, 16
    lengths = [5, 290, 77]
    gen = torch.Generator().manual_seed(9)
    k_cache = torch.randn(40, bs, hkv, d, generator=gen)
    v_cache = torch.randn(40, bs, hkv, d, generator=gen)
    tables = random_tables([n + 1 for n in lengths], bs, 40, gen)
    q, k, v, ctx = decode_step(tables, lengths, bs, h, hkv, d, seed=10)
    wide = torch.cat([tables, torch.full((3, 40), -1)], 1)
    outs = [triton_backend.attention(q, k, v, k_cache.clone(), v_cache.clone(),
                                     Context(**{**ctx.__dict__, "block_tables": t}), d ** -0.5,
                                     window=window)
            for t in (tables, wide)]
    assert torch.equal(outs[0], outs[1])
    assert not outs[0].isnan().any()


def test_store_kvcache_skips_padding_slots():
    k_cache = torch.zeros(4, 16, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    triton_backend.store_kvcache(k, v, k_cache, v_cache, torch.tensor([5, -1, 40]))
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[40], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[40], v[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2   # nothing else was written


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, triton_backend._tanh(tl.load(x_ptr + offs)))


def test_tanh_is_accurate_across_the_series_switch():
    x = torch.cat([torch.linspace(-3, 3, 1000), torch.tensor([0.0, 0.2499, 0.25, -1e-6, 30.0])])
    x = torch.cat([x, torch.zeros(1024 - len(x))])
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=1024)
    torch.testing.assert_close(y.double(), torch.tanh(x.double()), atol=1e-7, rtol=4e-7)


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


AOT_SCRIPT = """
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from pagedllm.attention import triton_backend as tb

def build(fn, ptrs, consts, num_warps, num_stages, arch):
    sig = {n: "constexpr" if n in consts else "*" + ptrs[n] if n in ptrs
           else "fp32" if n in ("qk_scale", "cap_log2e") else "i32" for n in fn.arg_names}
    # as the JIT specialises them: 16-byte-aligned pointers and head strides
    aligned = [(i,) for i, n in enumerate(fn.arg_names)
               if arch == 90 and (n.endswith("_ptr") or n in ("c_sb", "c_st", "c_sh"))]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts,
                                    attrs={i: [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})

TY = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
for arch, t, hd, group, feats in [(90, "bf16", 128, 2, False), (90, "fp32", 256, 8, True),
                                  (80, "fp16", 80, 1, True)]:
    dtype, d_p2, i64 = TY[t], tb._padded(hd), "i64"
    opts = dict(HAS_WINDOW=feats, HAS_SOFTCAP=feats, DOT_PRECISION=tb._dot_precision(dtype))
    bm, bn, nw, ns = tb.prefill_tiles(dtype, hd)
    p = build(tb._prefill_kernel, dict(q_ptr=t, k_ptr=t, v_ptr=t, k_cache_ptr=t, v_cache_ptr=t,
              o_ptr=t, cu_seqlens_q_ptr=i64, cu_seqlens_k_ptr=i64, block_tables_ptr=i64),
              dict(GROUP=group, HEAD_DIM=hd, D_P2=d_p2, BLOCK_SIZE=16, BLOCK_M=bm, BLOCK_N=bn,
                   **opts), nw, ns, arch)
    block_n, warps = tb.decode_tiles(dtype, hd)
    s = build(tb._decode_split_kernel, dict(q_ptr=t, k_cache_ptr=t, v_cache_ptr=t,
              m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32", context_lens_ptr=i64,
              block_tables_ptr=i64),
              dict(NUM_HEADS=8 * group, GROUP=group, GROUP_P2=16, HEAD_DIM=hd, D_P2=d_p2,
                   BLOCK_SIZE=16, BLOCK_N=block_n, SPLIT=tb.decode_split(hd), **opts),
              warps, 2, arch)
    r = build(tb._decode_reduce_kernel, dict(m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32",
              o_ptr=t, context_lens_ptr=i64),
              dict(NUM_HEADS=8 * group, HEAD_DIM=hd, D_P2=d_p2, SPLIT=tb.decode_split(hd),
                   HAS_WINDOW=feats), 4, 2, arch)
    print("SMEM", arch, t, hd, p.metadata.shared, s.metadata.shared, r.metadata.shared)
"""


def test_kernels_compile_for_hopper_and_ampere_without_a_gpu():
    # ptxas ships with triton: compile a few variants for sm_90 / sm_80 to cubin, in a
    # process without TRITON_INTERPRET, and keep shared memory well under the limits.
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(AOT_SCRIPT)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l.split() for l in proc.stdout.splitlines() if l.startswith("SMEM")]
    assert len(lines) == 3
    for line in lines:
        assert max(int(x) for x in line[4:]) < 160 * 1024, line
