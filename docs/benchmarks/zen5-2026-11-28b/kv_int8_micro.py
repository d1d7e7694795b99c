"""Decode attention over a bf16 and an int8 KV cache, in one process, alternating: ROWS
rows of one new token each over CTX cached tokens in blocks scattered over the pool, every
layer of a model's shape (SHAPE=heads,kv_heads,head_dim,layers; Qwen3-0.6B's by default),
the caches evicted before each timed call (a 256 MB read, as a decode step's weight stream
does). Best of REPS per cache type; the bytes are those each cache holds for the rows.

Usage: python kv_int8_micro.py CTX ROWS
"""
import os
import sys
import time

import torch

from pagedllm import memory
from pagedllm.attention import kv_quant
from pagedllm.kernels import ops

HEADS, KV_HEADS, HEAD_DIM, LAYERS = map(int, os.environ.get("SHAPE", "16,8,128,28").split(","))
BLOCK = 16


def main() -> None:
    ctx, rows = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    blocks = (ctx + BLOCK - 1) // BLOCK
    pool = rows * blocks + 8
    values = torch.randn(2, LAYERS, pool, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"bf16": memory.zeros(values.shape, torch.bfloat16),
              "int8": memory.zeros((*values.shape[:-1], HEAD_DIM + 4), torch.int8)}
    caches["bf16"].copy_(values.bfloat16())
    caches["int8"].copy_(kv_quant.quantize(values))
    tables = torch.randperm(pool)[:rows * blocks].view(rows, blocks).contiguous()
    q = torch.randn(rows, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    starts, ones = torch.arange(rows), torch.ones(rows, dtype=torch.long)
    lens = torch.full((rows,), ctx, dtype=torch.long)
    evict = torch.ones(64 << 20)
    best = {name: float("inf") for name in caches}
    for _ in range(int(os.environ.get("REPS", 15))):
        for name, kv in caches.items():
            evict.sum()
            t = time.perf_counter()
            for layer in range(LAYERS):
                ops.paged_attention(out, q, kv[0, layer], kv[1, layer], tables, starts, ones,
                                    lens, HEAD_DIM ** -0.5)
            best[name] = min(best[name], time.perf_counter() - t)
    for name, kv in caches.items():
        mb = rows * ctx * KV_HEADS * kv.shape[-1] * kv.element_size() * 2 * LAYERS / 1e6
        print(f"{name}: ctx {ctx} rows {rows}: {best[name] * 1e3:.3f} ms per {LAYERS} layers, "
              f"{mb:.1f} MB, {mb / best[name] / 1e3:.1f} GB/s")
    print(f"int8 / bf16 time: {best['int8'] / best['bf16']:.2f}")


if __name__ == "__main__":
    main()
