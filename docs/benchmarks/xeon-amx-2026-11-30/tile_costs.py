# What a TDPBF16PS costs at 1-16 rows: back to back (mode 0) and with the weight tile loaded
# and the sums stored around each product (mode 1, as a one-row step runs them).
from torch.utils.cpp_extension import load
e = load(name="tdplat", sources=["docs/benchmarks/xeon-amx-2026-11-30/tile_costs.cpp"], build_directory="/tmp/tdp", extra_cflags=["-O2", "-march=native", "-I/work/main/pagedllm/kernels/csrc", "-DPAGEDLLM_AMX"])
for mode in (0, 1):
    for rows in (1, 2, 4, 8, 16):
        e.bench(rows, 10000, mode)
        print(f"mode {mode} rows {rows}: {e.bench(rows, 200000, mode):.2f} ns per tile product (2.6 GHz: {e.bench(rows, 200000, mode)*2.6:.1f} cycles)")
