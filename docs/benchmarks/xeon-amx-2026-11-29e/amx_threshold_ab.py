# AMX-INT8 tiles against AVX512-VNNI tiles at 9-12 rows (amx-threshold-9-12.json). Two
# scratch builds of gguf_linear.cpp: /tmp/kb/a9 (kAmxMinRows 9, as it was) and /tmp/kb/a13
# (13: every row count here on VNNI), each g.cpp beside a bind.cpp exposing
# pagedllm::gguf_linear and force_gguf_linear_isa as gguf_linear(x, packed, qtype, n) and
# force(isa). Usage: python amx_threshold_ab.py OUT.json (2 threads, median of 8 rounds).
import torch, time, sys, statistics, json
from torch.utils.cpp_extension import load
def ld(v):
    return load(name="kb" + v, sources=[f"/tmp/kb/{v}/bind.cpp", f"/tmp/kb/{v}/g.cpp"], build_directory=f"/tmp/kb/{v}",
           extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-I/work/main/pagedllm/kernels/csrc"], extra_ldflags=["-fopenmp"])
exts = {v: ld(v) for v in ("a9", "a13")}
from pagedllm.layers.gguf_packing import pack_gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
torch.set_num_threads(2)
def mk(qt, n, k):
    block, ts_ = GGML_QUANT_SIZES[qt]
    return pack_gguf(qt, torch.randint(0, 256, (n, k // block * ts_), dtype=torch.uint8), n, k)
def once(f):
    t = time.perf_counter(); f(); return time.perf_counter() - t
out = []
for qt, n, k in [(Q.Q4_1, 3072, 576), (Q.Q4_1, 576, 1536), (Q.Q8_0, 49152, 576), (Q.Q4_K, 3072, 1024), (Q.Q6_K, 1024, 3072), (Q.Q8_0, 2048, 1024), (Q.Q4_K, 6144, 1024)]:
    pk = mk(qt, n, k)
    line = []
    for rows in (9, 10, 11, 12):
        x = torch.randn(rows, k).bfloat16()
        r = {nm: [] for nm in exts}
        for e in exts.values(): e.force("amx"); e.gguf_linear(x, pk, int(qt), n)
        for rnd in range(8):
            for name, e in exts.items():
                r[name].append(min(once(lambda: e.gguf_linear(x, pk, int(qt), n)) for _ in range(5)))
        med = {nm: statistics.median(v) * 1e3 for nm, v in r.items()}
        out.append({"type": qt.name, "n": n, "k": k, "rows": rows, "amx_ms": med["a9"], "vnni_ms": med["a13"]})
        line.append(f"{rows}: amx {med['a9']:.3f} vnni {med['a13']:.3f} ({med['a13']/med['a9']:.2f})")
    print(f"{qt.name} {n}x{k}  " + "  ".join(line), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
