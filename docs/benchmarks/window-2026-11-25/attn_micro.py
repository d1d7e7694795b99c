"""One attention layer, kernels (cpu_paged) vs torch_native, min of N runs."""
import time, torch
from pagedllm.attention import cpu_paged, torch_native
from pagedllm.attention.context import Context
torch.manual_seed(0)
def bench(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts) * 1e3
for name, H, KV, D, window in [("gemma3-local", 4, 1, 256, 512), ("mistral-w512", 32, 8, 128, 512)]:
    bs = 16
    for ctx_len in (2048, 8192):
        nb = ctx_len // bs + 4
        kc = torch.randn(nb, bs, KV, D, dtype=torch.bfloat16); vc = torch.randn_like(kc)
        table = torch.arange(ctx_len // bs + 1)[None]
        # decode: one row at position ctx_len
        q = torch.randn(1, H, D, dtype=torch.bfloat16); k = torch.randn(1, KV, D, dtype=torch.bfloat16); v = torch.randn_like(k)
        mk = lambda: Context(is_prefill=False, slot_mapping=torch.tensor([ctx_len]), block_tables=table, context_lens=torch.tensor([ctx_len + 1]))
        a = bench(lambda: cpu_paged.attention(q, k, v, kc, vc, mk(), D ** -0.5, window, None), 30)
        b = bench(lambda: torch_native.attention(q, k, v, kc, vc, mk(), D ** -0.5, window, None), 10)
        print(f"{name} decode ctx {ctx_len}: kernel {a:.2f} ms, torch {b:.2f} ms, {b / a:.1f}x")
        # prefill: a prompt of ctx_len tokens
        q = torch.randn(ctx_len, H, D, dtype=torch.bfloat16); k = torch.randn(ctx_len, KV, D, dtype=torch.bfloat16); v = torch.randn_like(k)
        slots = torch.arange(ctx_len)
        mp = lambda: Context(is_prefill=True, slot_mapping=slots, block_tables=table, seqlens_q=[ctx_len], seqlens_k=[ctx_len])
        a = bench(lambda: cpu_paged.attention(q, k, v, kc, vc, mp(), D ** -0.5, window, None), 3)
        a_full = bench(lambda: cpu_paged.attention(q, k, v, kc, vc, mp(), D ** -0.5, None, None), 2)
        b = bench(lambda: torch_native.attention(q, k, v, kc, vc, mp(), D ** -0.5, window, None), 2)
        print(f"{name} prompt {ctx_len}: kernel window {a:.0f} ms (no window {a_full:.0f} ms), torch window {b:.0f} ms, {b / a:.1f}x")
    # Gemma 2 style soft-cap, decode, ctx 4096 no window
    q = torch.randn(1, H, D, dtype=torch.bfloat16); k = torch.randn(1, KV, D, dtype=torch.bfloat16); v = torch.randn_like(k)
