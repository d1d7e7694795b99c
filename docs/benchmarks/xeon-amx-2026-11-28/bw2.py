import time, torch, sys
from pagedllm.kernels import ops, build
e = build.load()
torch.set_num_threads(2)
layer = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
ws = [[torch.randn(N, K, dtype=torch.bfloat16) for N, K in layer] for _ in range(24)]
head = torch.randn(151936, 896, dtype=torch.bfloat16)
allw = [w for l in ws for w in l] + [head]
nbytes = sum(w.numel() * 2 for w in allw)
pws = [ops.onednn_pack_linear_weight(w) for w in allw]
bws = [e.pack_linear_weight_bf16(w) for w in allw]
def packed(amx):
    def f():
        e.allow_amx_linear(amx)
        [e.packed_linear_bf16(xs[w.shape[1]], b) for w, b in zip(allw, bws)]
        e.allow_amx_linear(True)
    return f
for M in [int(a) for a in sys.argv[1:]]:
    xs = {K: torch.randn(M, K, dtype=torch.bfloat16) for K in (896, 4864)}
    variants = {"onednn": lambda: [ops.onednn_linear(xs[w.shape[1]], p, None) for w, p in zip(allw, pws)],
                "packed-amx": packed(True), "packed-dot": packed(False)}
    if M <= 4: variants["small"] = lambda: [ops.small_linear_bf16(xs[w.shape[1]], w) for w in allw]
    if 4 < M <= 32: variants["amx_linear"] = lambda: [ops.amx_linear_bf16(xs[w.shape[1]], w) for w in allw]
    res = {k: [] for k in variants}
    for r in range(4):
        for k, f in variants.items():
            t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
    print(f"M={M}: " + "; ".join(f"{k} {min(v[1:])*1e3:.0f} ms ({M*nbytes/min(v[1:])/1e9:.0f} GF/s)" for k, v in res.items()), flush=True)
