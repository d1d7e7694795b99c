import sys, time, torch
from pagedllm import LLM
from pagedllm.layers.moe import FusedMoE
from pagedllm.kernels import ops
llm = LLM(sys.argv[1], num_threads=2, kv_cache_memory_bytes=2**28)
model = llm.engine.model_runner.model
mods = [m for m in model.modules() if isinstance(m, FusedMoE)]
args = [m.kernel_experts() for m in mods]
E, k, H = mods[0].num_experts, mods[0].top_k, 2048
ebytes = [sum(p.packed.nbytes for p in w13 + w2) for w13, w2 in mods[0].gguf_experts]
torch.manual_seed(0)
for R in [int(r) for r in sys.argv[2:]]:
    x = torch.randn(R, H, dtype=torch.bfloat16)
    res = []
    for rep in range(5):
        tot_t, tot_b = 0.0, 0
        for it in range(40):
            li = it % len(mods)
            ids = torch.stack([torch.randperm(E)[:k] for _ in range(R)])
            w = torch.rand(R, k)
            t = time.perf_counter(); ops.moe_experts(x, ids, w, *args[li]); tot_t += time.perf_counter() - t
            tot_b += sum(ebytes[e] for e in set(ids.flatten().tolist()))
        res.append((tot_t / 40 * 1e3, tot_b / tot_t / 1e9))
    res.sort(key=lambda r: r[0])
    print(f"rows {R:3d}: " + "  ".join(f"{t:.3f} ms {g:.1f} GB/s" for t, g in res[:3]), flush=True)
