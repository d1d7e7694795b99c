"""Measure the machine in the same run as the engines: matmul peak and memory bandwidth.

The figures are best-of-several timings with the bench's thread count, so they are what
the engines could at most get on this machine right now (a shared machine measures lower).
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pagedllm import memory


@dataclass
class MachineMeasurement:
    threads: int
    matmul_gflops: dict[str, float]      # dtype name -> best GFLOP/s of a square matmul
    memory_read_gbs: float               # best GB/s of a reduction over a large buffer
    matvec_gbs: dict[str, float]         # dtype name -> GB/s torch's matrix-vector product streams

    def summary(self) -> dict:
        return asdict(self)


def _best_seconds(fn: Callable[[], object], min_reps: int, min_seconds: float) -> float:
    """Fastest of at least ``min_reps`` runs, repeating until ``min_seconds`` have passed."""
    fn()  # warm up (allocation, kernel selection)
    best, start, reps = float("inf"), time.perf_counter(), 0
    while reps < min_reps or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def matmul_gflops(dtype: torch.dtype, n: int = 2048, min_seconds: float = 1.0) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), 3, min_seconds)
    return 2 * n**3 / seconds / 1e9


def memory_read_gbs(nbytes: int = 512 * 2**20, min_seconds: float = 1.0) -> float:
    """Read bandwidth: a sum over a buffer far larger than the caches, on 2 MiB pages where
    the kernel allows (as pagedllm's weights and KV cache are: on 4 KiB pages the page
    walks cost 5-10% of the stream here, and the bound would be one pagedllm beats)."""
    x = memory.huge_page_bytes(nbytes // 4 * 4).view(torch.float32).fill_(1.0)
    seconds = _best_seconds(lambda: x.sum(), 3, min_seconds)
    return nbytes / seconds / 1e9


def matvec_gbs(dtype: torch.dtype, nbytes: int = 256 * 2**20, min_seconds: float = 1.0) -> float:
    """How fast torch streams a weight matrix through a matrix-vector product (decode at batch 1)."""
    cols = 4096
    rows = nbytes // (cols * dtype.itemsize)
    w = torch.randn(rows, cols).to(dtype)
    v = torch.randn(cols).to(dtype)
    seconds = _best_seconds(lambda: torch.mv(w, v), 3, min_seconds)
    return rows * cols * dtype.itemsize / seconds / 1e9


def measure_machine(threads: int, dtypes: list[torch.dtype], quick: bool = False) -> MachineMeasurement:
    """Matmul peak per dtype, read bandwidth and matvec streaming rate with ``threads`` threads.

    ``quick`` shrinks the sizes and repetitions (for tests): the figures are then rougher.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    n, secs, mem = (512, 0.1, 64 * 2**20) if quick else (2048, 1.0, 512 * 2**20)
    try:
        with torch.inference_mode():
            peak = {_name(dt): matmul_gflops(dt, n, secs) for dt in dtypes}
            read = memory_read_gbs(mem, secs)
            mv = {_name(dt): matvec_gbs(dt, mem // 2, secs) for dt in dtypes}
    finally:
        torch.set_num_threads(previous)
    return MachineMeasurement(threads, peak, read, mv)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def machine_info() -> dict:
    """What the machine is: CPU model and flags that matter, cores, RAM, load."""
    info: dict = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                  "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = next((l.split(":", 1)[1].strip() for l in text.splitlines()
                      if l.startswith("model name")), platform.processor())
        flags = next((l.split(":", 1)[1].split() for l in text.splitlines()
                      if l.startswith("flags")), [])
        info["cpu"] = model
        info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma")))
    except OSError:
        info["cpu"] = platform.processor()
    try:
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except (OSError, ValueError):
        pass
    return info
