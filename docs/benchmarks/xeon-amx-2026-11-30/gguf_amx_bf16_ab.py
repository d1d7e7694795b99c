# The GGUF kernel built twice from /tmp/kb/old/g.cpp and /tmp/kb/<variant>/g.cpp (+ bind.cpp
# exposing gguf_linear and force_gguf_linear_isa), one process, 2 threads: time at 1-256
# rows, error against float64, and whether a row alone equals it in a batch.
import torch, time, sys
from torch.utils.cpp_extension import load
def ld(v):
    return load(name="kb" + v, sources=[f"/tmp/kb/{v}/bind.cpp", f"/tmp/kb/{v}/g.cpp"], build_directory=f"/tmp/kb/{v}",
           extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-I/work/main/pagedllm/kernels/csrc"], extra_ldflags=["-fopenmp"])
A, B = ld("old"), ld(sys.argv[1])
from pagedllm.layers.gguf_packing import pack_gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
import gguf
sys.path.insert(0, '/work/main/tests/kernels'); sys.path.insert(0, '/work/main/tests')
from test_gguf_linear import random_gguf
torch.set_num_threads(2)
shapes = [("Q4_K", 3072, 1024), ("Q6_K", 3072, 1024), ("Q8_0", 3072, 1024), ("Q4_0", 1024, 1024), ("Q5_K", 1024, 3072), ("Q6_K", 151936, 1024)]
for name, n, k in shapes:
    qt = getattr(Q, name); block, ts_ = GGML_QUANT_SIZES[qt]
    raw = random_gguf(qt, n, k)
    if name in ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):  # sane fp16 scales
        pass
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qt)).double().reshape(n, k)
    ok = torch.isfinite(w).all()
    pk = pack_gguf(qt, raw, n, k)
    for rows in [1, 4, 16, 64, 256]:
        if n > 100000 and rows > 64: continue
        x = torch.randn(rows, k).bfloat16()
        ref = x.double() @ w.T if ok else None
        ya, yb = A.gguf_linear(x, pk, int(qt), n).double(), B.gguf_linear(x, pk, int(qt), n).double()
        if ref is not None and torch.isfinite(ref).all():
            sc = ref.abs().max()
            ea, eb = ((ya - ref).abs().max() / sc).item(), ((yb - ref).abs().max() / sc).item()
        else: ea = eb = float('nan')
        # batch invariance of B: first row alone
        inv = torch.equal(B.gguf_linear(x[:1], pk, int(qt), n), B.gguf_linear(x, pk, int(qt), n)[:1])
        tt = {}
        for nm, e in (("old", A), ("new", B)):
            best = 1e9
            for _ in range(3 if n > 100000 else 10):
                t = time.perf_counter(); e.gguf_linear(x, pk, int(qt), n); best = min(best, time.perf_counter() - t)
            tt[nm] = best * 1e3
        print(f"{name} {n}x{k} rows {rows:3d}: old {tt['old']:.3f} new {tt['new']:.3f} ms new/old {tt['new']/tt['old']:.2f}  err old {ea:.1e} new {eb:.1e} row-alone-equal {inv}", flush=True)
