"""Time the Triton paged-attention kernels on a CUDA GPU at Qwen3-0.6B's attention shape
(16 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks).

Decode (split-K kernel + reduce) at batch x context 1 x 4096, 64 x 1024, 256 x 512, and
prefill of 8 fresh 1024-token prompts; median of triton.testing.do_bench. Decode reports
GB/s of K/V read (batch * context * kv_heads * head_dim * 2 tensors * 2 bytes / time),
prefill TFLOP/s (4 * heads * head_dim * causal query-key pairs / time). Beside each, torch's
SDPA over dense, unpaged tensors of the same sizes (flash / cuDNN), as a yardstick; and a
small sweep of prefill tiles. Prints a table; --output-json writes the figures.

    python scripts/gpu_attention_bench.py --output-json gpu_attention.json

Exits 0 with a message when there is no CUDA device. About 20-40 s on an H100.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

H, HKV, D, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(1, 4096), (64, 1024), (256, 512)]
PREFILL_SEQS, PREFILL_LEN = 8, 1024
TILE_SWEEP = [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 3)]


def bench_ms(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def paged_cache(batch: int, context: int, gen: torch.Generator):
    """K/V caches holding batch sequences of `context` tokens in shuffled blocks."""
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, per_seq)
    return k_cache, v_cache, tables


def bench_decode(batch: int, context: int, gen: torch.Generator) -> dict:
    from pagedllm.attention import triton_backend
    from pagedllm.attention.context import Context

    k_cache, v_cache, tables = paged_cache(batch, context, gen)
    q = torch.randn(batch, H, D, device="cuda", dtype=DTYPE, generator=gen)
    ctx = Context(is_prefill=False, block_tables=tables,
                  context_lens=torch.full((batch,), context, device="cuda"))
    scale = D ** -0.5
    ms = bench_ms(lambda: triton_backend.decode_attention(q, k_cache, v_cache, ctx, scale))
    # yardstick: SDPA over contiguous [batch, kv_heads, context, D] K/V (no paging)
    kd = k_cache[tables].flatten(1, 2).transpose(1, 2).contiguous()
    vd = v_cache[tables].flatten(1, 2).transpose(1, 2).contiguous()
    qd = q[:, :, None, :]
    sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale,
                                                              enable_gqa=True))
    kv_bytes = batch * context * HKV * D * 2 * DTYPE.itemsize
    return dict(batch=batch, context=context, ms=ms, gb_s=kv_bytes / ms / 1e6,
                sdpa_dense_ms=sdpa_ms, sdpa_dense_gb_s=kv_bytes / sdpa_ms / 1e6)


def bench_prefill(gen: torch.Generator, tiles: tuple[int, int, int, int] | None = None
                  ) -> dict:
    from pagedllm.attention import triton_backend
    from pagedllm.attention.context import Context

    n, length = PREFILL_SEQS, PREFILL_LEN
    q = torch.randn(n * length, H, D, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(n * length, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn_like(k)
    cu = torch.arange(0, (n + 1) * length, length, device="cuda")
    ctx = Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length,
                  max_seqlen_k=length)
    empty = torch.empty(0, BLOCK, HKV, D, device="cuda", dtype=DTYPE)
    o = torch.empty_like(q)
    scale = D ** -0.5
    ms = bench_ms(lambda: triton_backend.prefill_attention(q, k, v, empty, empty, ctx, scale,
                                                           o, tiles=tiles))
    flops = 4 * H * D * n * length * (length + 1) / 2
    result = dict(seqs=n, length=length, tiles=list(tiles or triton_backend.prefill_tiles(
        DTYPE, D)), ms=ms, tflops=flops / ms / 1e9)
    if tiles is None:
        qd, kd, vd = (t.view(n, length, -1, D).transpose(1, 2) for t in (q, k, v))
        sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                                  scale=scale, enable_gqa=True))
        result.update(sdpa_dense_ms=sdpa_ms, sdpa_dense_tflops=flops / sdpa_ms / 1e9)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, help="write the figures here")
    parser.add_argument("--no-sweep", action="store_true", help="skip the prefill tile sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time (the Triton kernels need a GPU; run this on "
              "one)")
        return 0
    import triton

    t0 = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    report: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                        triton=triton.__version__, shape=dict(heads=H, kv_heads=HKV,
                                                              head_dim=D, block_size=BLOCK,
                                                              dtype=str(DTYPE)),
                        decode=[], prefill=[], prefill_tile_sweep=[], errors=[])
    print(f"{report['device']}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'decode batch x ctx':>20} {'ms':>8} {'GB/s':>8} {'SDPA dense ms':>14} {'GB/s':>8}")
    for batch, context in DECODE_SHAPES:
        try:
            r = bench_decode(batch, context, gen)
        except Exception as exc:  # record and go on: one failure should not hide the rest
            report["errors"].append(f"decode {batch}x{context}: {exc!r}")
            print(f"{batch:>9} x {context:<8} FAILED: {exc!r}")
            continue
        report["decode"].append(r)
        print(f"{batch:>9} x {context:<8} {r['ms']:8.4f} {r['gb_s']:8.0f} "
              f"{r['sdpa_dense_ms']:14.4f} {r['sdpa_dense_gb_s']:8.0f}")
    print(f"{'prefill seqs x len':>20} {'ms':>8} {'TFLOP/s':>8} {'SDPA dense ms':>14} "
          f"{'TFLOP/s':>8}")
    try:
        r = bench_prefill(gen)
        report["prefill"].append(r)
        print(f"{PREFILL_SEQS:>9} x {PREFILL_LEN:<8} {r['ms']:8.4f} {r['tflops']:8.1f} "
              f"{r['sdpa_dense_ms']:14.4f} {r['sdpa_dense_tflops']:8.1f}  tiles {r['tiles']}")
    except Exception as exc:
        report["errors"].append(f"prefill: {exc!r}")
        print(f"prefill FAILED: {exc!r}")
    if not args.no_sweep:
        print("prefill tiles (BLOCK_M, BLOCK_N, warps, stages):")
        for tiles in TILE_SWEEP:
            try:
                r = bench_prefill(gen, tiles)
            except Exception as exc:
                report["prefill_tile_sweep"].append(dict(tiles=list(tiles), error=repr(exc)))
                print(f"  {tiles}: FAILED {exc!r}")
                continue
            report["prefill_tile_sweep"].append(r)
            print(f"  {tiles}: {r['ms']:.4f} ms, {r['tflops']:.1f} TFLOP/s")
    report["wall_s"] = time.perf_counter() - t0
    print(f"done in {report['wall_s']:.1f} s")
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
