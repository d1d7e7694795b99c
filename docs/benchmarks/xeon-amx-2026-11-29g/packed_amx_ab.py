# Two scratch builds of packed_linear.cpp side by side (/tmp/pb/old, /tmp/pb/new): bf16 linears
# on AMX at prompt and decode row counts, one process, 2 threads, median of rounds of best of 3.
import torch, time, sys, statistics, json
from torch.utils.cpp_extension import load
def ld(v):
    return load(name="pb" + v, sources=[f"/tmp/pb/{v}/bind.cpp", f"/tmp/pb/{v}/p.cpp", f"/tmp/pb/{v}/e.cpp"], build_directory=f"/tmp/pb/{v}",
           extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-I/work/main/pagedllm/kernels/csrc"], extra_ldflags=["-fopenmp"])
exts = {v: ld(v) for v in ("old", "new")}
torch.set_num_threads(2)
out = []
for n, k in [(4096, 4096), (14336 * 2, 4096), (4096, 14336), (1152, 1152), (6912 * 2, 1152)]:
    w = (torch.randn(n, k) * 0.02).bfloat16()
    pk = exts["old"].pack(w)
    for rows in [int(r) for r in sys.argv[2:]]:
        x = torch.randn(rows, k).bfloat16()
        a, b = exts["old"].linear(x, pk), exts["new"].linear(x, pk)
        assert torch.equal(a, b), (n, k, rows)
        r = {nm: [] for nm in exts}
        for rnd in range(5):
            for nm, e in exts.items():
                ts = []
                for _ in range(3):
                    t = time.perf_counter(); e.linear(x, pk); ts.append(time.perf_counter() - t)
                r[nm].append(min(ts))
        med = {nm: statistics.median(v) * 1e3 for nm, v in r.items()}
        tf = 2 * rows * n * k / 1e9
        out.append({"n": n, "k": k, "rows": rows, **{f"{nm}_ms": v for nm, v in med.items()}})
        print(f"{n}x{k} rows {rows}: old {med['old']:.2f} ms ({tf/med['old']:.0f} GFLOP/s) new {med['new']:.2f} ms ({tf/med['new']:.0f})  new/old {med['new']/med['old']:.2f}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
