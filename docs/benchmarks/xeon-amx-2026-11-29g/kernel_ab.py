# Two scratch builds of gguf_linear.cpp side by side (/tmp/kb/old, /tmp/kb/new), one
# process, 2 threads, median over rounds of the best of 5 calls, weights cycled so that they
# come from memory/L3 as in decode. Usage: python ab.py OUT.json ROWS...
import torch, time, sys, statistics, json
from torch.utils.cpp_extension import load
def ld(v):
    return load(name="kb" + v, sources=[f"/tmp/kb/{v}/bind.cpp", f"/tmp/kb/{v}/g.cpp"], build_directory=f"/tmp/kb/{v}",
           extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-I/work/main/pagedllm/kernels/csrc"], extra_ldflags=["-fopenmp"])
exts = {v: ld(v) for v in ("old", "new")}
from pagedllm.layers.gguf_packing import pack_gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
torch.set_num_threads(2)
rows_list = [int(r) for r in sys.argv[2:]] or [1]
def mk(qt, n, k, seed):
    block, ts_ = GGML_QUANT_SIZES[qt]
    g = torch.Generator().manual_seed(seed)
    return pack_gguf(qt, torch.randint(0, 256, (n, k // block * ts_), dtype=torch.uint8, generator=g), n, k)
out = []
shapes = [(Q.Q4_K, 6144, 1024), (Q.Q6_K, 6144, 1024), (Q.Q5_K, 6144, 1024), (Q.Q8_0, 6144, 1024), (Q.Q4_1, 1536, 576),
          (Q.Q6_K, 151936, 1024), (Q.Q4_K, 2048, 8192), (Q.Q6_K, 2048, 8192)]
for qt, n, k in shapes:
    copies = max(1, (600 << 20) // (n * k))  # cycle through ~600 MB+ of weights
    copies = min(copies, 8)
    pks = [mk(qt, n, k, s) for s in range(copies)]
    for rows in rows_list:
        x = torch.randn(rows, k).bfloat16()
        for e in exts.values(): e.gguf_linear(x, pks[0], int(qt), n)
        r = {nm: [] for nm in exts}
        for rnd in range(9):
            for name, e in exts.items():
                ts = []
                for i in range(5):
                    pk = pks[(rnd * 5 + i) % copies]
                    t = time.perf_counter(); e.gguf_linear(x, pk, int(qt), n); ts.append(time.perf_counter() - t)
                r[name].append(min(ts))
        med = {nm: statistics.median(v) * 1e3 for nm, v in r.items()}
        out.append({"type": qt.name, "n": n, "k": k, "rows": rows, **{f"{nm}_ms": v for nm, v in med.items()}})
        print(f"{qt.name} {n}x{k} rows {rows}: old {med['old']:.3f} new {med['new']:.3f} ms  new/old {med['new']/med['old']:.2f}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
