"""Microbenchmark of the GGUF kernel (csrc/gguf_linear.cpp) for each type it takes, against
the bf16 kernel (csrc/packed_linear.cpp), on random packed weights:

    python -m pagedllm.bench.kernels [--rows 1 4 16] [--types Q4_0 Q4_K] [--json out.json]

Shapes 3072 x 1024 (a 0.6B model's MLP projection; enough different weights taken in turn
that they do not fit the 32 MB L3: each call reads its weight from memory, as decode does)
and 151936 x 1024 (Qwen3's LM head, one weight). Each figure is the best of `--repeats`
runs, ms per call; at one row also GB/s of weight bytes read (the packed bytes; bf16: 2
bytes a weight). The random blocks are random_gguf's (valid scales, random quants): the
speed does not depend on the values. Timings on a shared machine are noisy: compare the
types within one run.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.bench.random_gguf import _random_rows
from pagedllm.kernels import ops
from pagedllm.layers.gguf_packing import SUPPORTED_TYPES, pack_gguf

SHAPES = ((3072, 1024), (151936, 1024))
ROWS = (1, 4, 16, 64, 256)
CACHE_BYTES = 32 * 2**20  # L3: the small shape cycles through at least 3x this


def _copies(n: int, k: int, nbytes: int) -> int:
    """How many weights of nbytes a shape takes in turn (one for the large shape)."""
    return 1 if n * k > 64 * 2**20 else max(2, -(-3 * CACHE_BYTES // nbytes))


def weights(kind: str, n: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    """The packed weights one shape's timings take in turn: a GGUF type's pack_gguf bytes
    or (kind "bf16") packed_linear's layout; copies of one random weight in distinct memory."""
    rng = np.random.default_rng(seed)
    if kind == "bf16":
        w = ops.pack_linear_weight_bf16(
            (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16())
    else:
        qtype = GGMLQuantizationType[kind]
        raw = torch.from_numpy(_random_rows(qtype, n, k, rng))
        w = pack_gguf(qtype, raw, n, k)
    nbytes = w.numel() * w.element_size()
    return [w] + [w.clone() for _ in range(_copies(n, k, nbytes) - 1)]


def linear_of(kind: str, n: int, gguf_linear: Callable = ops.gguf_linear) -> Callable:
    """x, packed -> x . w^T for kind (gguf_linear: the GGUF kernel's entry point to time)."""
    if kind == "bf16":
        return ops.packed_linear_bf16
    qtype = int(GGMLQuantizationType[kind])
    return lambda x, w: gguf_linear(x, w, qtype, n)


def time_calls(fn: Callable, ws: list[torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    """ms per call, the best of `repeats` runs; each run calls fn once on every weight of
    ws in turn (after one warm-up pass)."""
    for w in ws:
        fn(x, w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in ws:
            fn(x, w)
        best = min(best, (time.perf_counter() - t) / len(ws))
    return best * 1e3


def run(kinds: list[str], rows: tuple[int, ...] = ROWS, shapes=SHAPES, repeats: int = 5,
        gguf_linears: dict[str, Callable] | None = None) -> list[dict]:
    """One record per (shape, kind, rows): ms per call and, at one row, GB/s.
    gguf_linears: other entry points to time beside ops.gguf_linear, by a label (their
    kinds are "<kind>@<label>": comparing two builds of the kernel in one run)."""
    out = []
    for n, k in shapes:
        x_of = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                for m in rows}
        for kind in kinds:
            ws = weights(kind, n, k)
            nbytes = ws[0].numel() * ws[0].element_size()
            fns = {kind: linear_of(kind, n)}
            if kind != "bf16":
                for label, fn in (gguf_linears or {}).items():
                    fns[f"{kind}@{label}"] = linear_of(kind, n, fn)
            for name, fn in fns.items():
                for m in rows:
                    ms = time_calls(fn, ws, x_of[m], repeats)
                    rec = {"n": n, "k": k, "kind": name, "rows": m, "ms": ms,
                           "weights": len(ws), "weight_bytes": nbytes}
                    if m == 1:
                        rec["gb_per_s"] = nbytes / ms / 1e6
                    out.append(rec)
            del ws
    return out


def table(records: list[dict]) -> str:
    kinds = list(dict.fromkeys(r["kind"] for r in records))
    lines = ["| N x K | rows | " + " | ".join(kinds) + " |",
             "| --- | --- | " + " | ".join("---" for _ in kinds) + " |"]
    keys = list(dict.fromkeys((r["n"], r["k"], r["rows"]) for r in records))
    by = {(r["n"], r["k"], r["rows"], r["kind"]): r for r in records}
    for n, k, m in keys:
        cells = []
        for kind in kinds:
            r = by.get((n, k, m, kind))
            cell = "" if r is None else f"{r['ms']:.3f}"
            if r is not None and "gb_per_s" in r:
                cell += f" ({r['gb_per_s']:.0f})"
            cells.append(cell)
        lines.append(f"| {n} x {k} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["bf16"] + [t.name for t in SUPPORTED_TYPES],
                   help="bf16 and/or GGUF type names")
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES],
                   help="NxK")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the records here")
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes]
    records = run(a.types, tuple(a.rows), shapes, a.repeats)
    print(f"threads {torch.get_num_threads()}, gguf_linear on {ops.gguf_linear_isa()}; "
          f"ms per call (best of {a.repeats}), at one row GB/s of weight bytes")
    print(table(records))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "isa": ops.gguf_linear_isa(),
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
