"""A/B of gguf_linear.cpp variants, in one process:

    .venv/bin/python docs/benchmarks/zen5-2026-11-27/kernel_ab.py a.cpp b.cpp ... -- Q4_K Q8_0

env ROWS (comma list), SHAPES (NxK,...), REPS. Builds each variant as a small extension
(under /tmp/ab), checks that its outputs equal the first variant's bit for bit and that
each row alone equals the same row in the batch, then times the variants in turn (best
of REPS; GFLOP/s, one column per variant)."""
import os, sys, shutil, time, hashlib
from pathlib import Path
import torch
from torch.utils.cpp_extension import load
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from pagedllm.kernels import ops
from pagedllm.bench import kernels as kb
from gguf import GGMLQuantizationType

CSRC = REPO / "pagedllm/kernels/csrc"
MODULE = r'''
#include "ops.h"
#include <torch/extension.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &pagedllm::gguf_linear, py::arg("x"), py::arg("packed"), py::arg("qtype"),
        py::arg("n"), py::arg("out") = py::none(), py::arg("fp32_out") = false);
}
'''
argv = sys.argv[1:]
sep = argv.index("--")
variants, types = argv[:sep], argv[sep + 1:]
mods = []
for v in variants:
    src = Path(v).read_text()
    h = hashlib.md5(src.encode()).hexdigest()[:8]
    d = Path(f"/tmp/ab/build_{Path(v).stem}_{h}")
    d.mkdir(parents=True, exist_ok=True)
    for f in ("ops.h", "simd.h", "amx.h"):
        shutil.copy(CSRC / f, d / f)
    (d / "gguf_linear.cpp").write_text(src)
    (d / "mod.cpp").write_text(MODULE)
    t = time.time()
    m = load(name=f"ab_{Path(v).stem}_{h}", sources=[str(d / "gguf_linear.cpp"), str(d / "mod.cpp")],
             build_directory=str(d), extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
             "-fno-trapping-math", "-ffp-contract=off", "-std=c++20"], extra_ldflags=["-fopenmp"],
             extra_include_paths=[str(d)], verbose=False)
    print(f"built {v} in {time.time()-t:.0f}s", flush=True)
    mods.append(m)
rows = [int(r) for r in os.environ.get("ROWS", "1,16,64,256").split(",")]
shapes = [tuple(int(a) for a in s.split("x")) for s in os.environ.get("SHAPES", "3072x1024,1024x3072").split(",")]
reps = int(os.environ.get("REPS", "5"))
torch.manual_seed(0)
for ty in types:
    q = int(GGMLQuantizationType[ty])
    for (n, k) in shapes:
        ws = kb.weights(ty, n, k)
        x = torch.randn(max(rows), k).bfloat16()
        ref = mods[0].gguf_linear(x, ws[0], q, n)
        for m in mods[1:]:
            y = m.gguf_linear(x, ws[0], q, n)
            assert torch.equal(y, ref), f"{ty} {n}x{k}: variant differs"
        for m in mods:
            for r in rows:
                y1 = m.gguf_linear(x[r-1:r].contiguous(), ws[0], q, n)
                assert torch.equal(y1[0], ref[r-1]), f"{ty} batch invariance broken at {r}"
        for r in rows:
            xr = x[:r].contiguous()
            best = [float("inf")] * len(mods)
            for rep in range(reps):
                for j, m in enumerate(mods):
                    t = time.perf_counter(); c = 0
                    for w in ws:
                        m.gguf_linear(xr, w, q, n); c += 1
                    best[j] = min(best[j], (time.perf_counter() - t) / c)
            gf = [2 * r * n * k / b / 1e9 for b in best]
            print(f"{ty} {n}x{k} rows {r:4d}: " + "  ".join(f"{g:7.1f}" for g in gf) + " GFLOP/s", flush=True)
