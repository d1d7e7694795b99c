"""One stream's paged attention over a model's layers (SmolLM2's 30 by default), the caches
evicted first: the measurement behind paged_attention.cpp's kPrefetchBlocks and its split of
a row over the threads (docs/kernels.md, paged attention).

SHAPE=heads,kv_heads,head_dim,layers picks the model (SmolLM2: 9,3,64,30; Gemma 3 1B:
4,1,256,26), THREADS the threads (2). The KV cache is laid out as the engine lays it out (one tensor [2, layers,
blocks, 16, kv_heads, head_dim] bf16 on 2 MiB pages); ROWS rows of QLEN query tokens (1: a decode, 5: a verify step of
4 drafts) each attend to CTX tokens held in blocks taken in order ("seq") or scattered over
the pool ("rand"). Before each timed call a 256 MB read evicts the caches, as a decode
step's weight stream does between two layers' attention. Best of REPS.

Usage: python attn_decode_micro.py CTX QLEN [ROWS] [seq|rand|noflush]
To compare two builds of the kernel, run it under each in turn (the extension is cached
per source), alternating, several rounds.
"""
import os
import sys
import time

import torch

from pagedllm import memory
from pagedllm.kernels import ops

HEADS, KV_HEADS, HEAD_DIM, LAYERS = map(int, os.environ.get("SHAPE", "9,3,64,30").split(","))
BLOCK, POOL = 16, 2912 * 3 * 64 // (KV_HEADS * HEAD_DIM)   # the same bytes whatever the shape


def main() -> None:
    ctx, qlen = int(sys.argv[1]), int(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    order = sys.argv[4] if len(sys.argv) > 4 else "rand"
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    blocks = (ctx + BLOCK - 1) // BLOCK
    kv = memory.zeros((2, LAYERS, POOL, BLOCK, KV_HEADS, HEAD_DIM), torch.bfloat16)
    kv.copy_(torch.randn(kv.shape).bfloat16())
    ids = torch.randperm(POOL) if order == "rand" else torch.arange(POOL)
    tables = ids[:rows * blocks].view(rows, blocks).contiguous()
    q = torch.randn(rows * qlen, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    q_starts = torch.arange(rows, dtype=torch.long) * qlen
    q_lens = torch.full((rows,), qlen, dtype=torch.long)
    k_lens = torch.full((rows,), ctx, dtype=torch.long)
    evict = torch.ones(64 << 20)
    best = float("inf")
    for _ in range(int(os.environ.get("REPS", 20))):
        if order != "noflush":
            evict.sum()
        t = time.perf_counter()
        for layer in range(LAYERS):
            ops.paged_attention(out, q, kv[0, layer], kv[1, layer], tables, q_starts, q_lens,
                                k_lens, HEAD_DIM ** -0.5)
        best = min(best, time.perf_counter() - t)
    mb = rows * ctx * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS / 1e6
    print(f"ctx {ctx} qlen {qlen} rows {rows} {order}: {best * 1e3:.3f} ms per {LAYERS} layers, "
          f"{mb:.1f} MB, {mb / best / 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
