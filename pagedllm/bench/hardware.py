"""Measure the machine in the same run as the engines: matmul peak and memory bandwidth.

On the CPU the figures are best-of-several timings with the bench's thread count, so they
are what the engines could at most get on this machine right now (a shared machine
measures lower). On CUDA they are the device's: a large bf16 (or the run's dtype) matmul
and a device-to-device copy, timed with CUDA events (median of a few runs, a few seconds
in all); nothing on the host is measured then, since no engine computes there.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pagedllm import memory


CPU_BANDWIDTH_METHOD = "read: a sum over a buffer far larger than the caches (best of several)"
CUDA_BANDWIDTH_METHOD = "device-to-device copy, bytes read + bytes written (median of CUDA-event timings)"


@dataclass
class MachineMeasurement:
    threads: int
    matmul_gflops: dict[str, float]      # dtype name -> GFLOP/s of a square matmul
    # GB/s the roofline's memory bound uses: on the CPU a reduction over a large buffer,
    # on CUDA a device-to-device copy (bytes read + written), see bandwidth_method
    memory_read_gbs: float
    matvec_gbs: dict[str, float]         # dtype name -> GB/s torch's matrix-vector product streams (CPU)
    device: str = "cpu"                  # where the matmul and bandwidth were measured
    device_name: str | None = None       # torch.cuda.get_device_name() on CUDA
    bandwidth_method: str = CPU_BANDWIDTH_METHOD
    matmul_size: int | None = None       # n of the n x n x n matmul
    seconds: float | None = None         # how long the measurement took

    @property
    def bandwidth_gbs(self) -> float:
        return self.memory_read_gbs

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


def measure_machine(threads: int, dtypes: list[torch.dtype], quick: bool = False,
                    device: str = "cpu") -> MachineMeasurement:
    """Matmul peak per dtype, read bandwidth and matvec streaming rate with ``threads`` threads;
    on ``device`` "cuda" the GPU's matmul rate and copy bandwidth instead (measure_cuda).

    ``quick`` shrinks the sizes and repetitions (for tests): the figures are then rougher.
    """
    if device == "cuda":
        return measure_cuda(threads, dtypes, quick)
    start = time.perf_counter()
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
    return MachineMeasurement(threads, peak, read, mv, matmul_size=n,
                              seconds=round(time.perf_counter() - start, 2))


# ---- CUDA ----------------------------------------------------------------------------------

def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued kernels (a no-op on the CPU): clocks read after it
    count the work launched before it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], iters: int, device: str = "cpu",
                   warmup: int = 3) -> float:
    """Median seconds of ``iters`` runs of fn after ``warmup`` untimed ones. On CUDA each
    run is timed by CUDA events around it (no host round trip per run); on the CPU by
    the host clock."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def device_matmul_gflops(dtype: torch.dtype, n: int = 8192, iters: int = 10,
                         device: str = "cuda") -> float:
    """GFLOP/s of an n x n by n x n matmul of random data on ``device`` (2 n^3 FLOPs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: torch.matmul(a, b, out=out), iters, device)
    return 2 * n**3 / seconds / 1e9


def device_copy_gbs(nbytes: int = 2**30, iters: int = 10, device: str = "cuda") -> float:
    """GB/s of copying an nbytes buffer into another on ``device``: 2 * nbytes move (read +
    write), as a decode step's bytes are counted (weights and K/V read)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), iters, device)
    return 2 * nbytes / seconds / 1e9


def measure_cuda(threads: int, dtypes: list[torch.dtype], quick: bool = False,
                 device: str = "cuda") -> MachineMeasurement:
    """The GPU's matmul rate per dtype (8192^3, 10 timed runs; quick: 4096^3) and copy
    bandwidth (a 1 GiB buffer copied, 2 GiB moved; quick: 256 MiB). Its buffers are given
    back to the driver afterwards, so the engine's KV budget (a fraction of the free
    memory) does not see them."""
    start = time.perf_counter()
    n, nbytes, iters = (4096, 256 * 2**20, 5) if quick else (8192, 2**30, 10)
    try:
        with torch.inference_mode():
            peak = {_name(dt): device_matmul_gflops(dt, n, iters, device) for dt in dtypes}
            copy = device_copy_gbs(nbytes, iters, device)
    finally:
        torch.cuda.empty_cache()
    return MachineMeasurement(threads, peak, copy, {}, device="cuda",
                              device_name=torch.cuda.get_device_name(device),
                              bandwidth_method=CUDA_BANDWIDTH_METHOD, matmul_size=n,
                              seconds=round(time.perf_counter() - start, 2))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cuda_info(device: str = "cuda") -> dict:
    """What the GPU is: name, memory, compute capability, and the CUDA torch was built with."""
    props = torch.cuda.get_device_properties(device)
    return {"gpu": torch.cuda.get_device_name(device), "gpu_count": torch.cuda.device_count(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda, "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version()}


def machine_info(device: str = "cpu") -> dict:
    """What the machine is: CPU model and flags that matter, cores, RAM, load; on device
    "cuda" the GPU too (cuda_info)."""
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
    info["device"] = device
    if device == "cuda":
        info.update(cuda_info())
    return info
