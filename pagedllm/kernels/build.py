"""Building and loading the C++ CPU kernels (kernels/csrc) as one torch extension.

`scripts/setup.sh` builds them (`python -m pagedllm.kernels.build`, about a minute) so the
first request does not wait; the build is cached under TORCH_EXTENSIONS_DIR, keyed by the
sources, their directory and the flags. -march=native: the build is for the machine it runs
on, so AVX-512 / AVX512-BF16 / AMX paths are used exactly where the CPU has them. If the
build fails (no compiler), load() returns None with one warning and the engine runs on
torch's own ops (torch_native attention, F.linear), which stay the reference.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

# A build lock older than this belongs to a builder that died (a build takes ~1 min).
STALE_LOCK_SECONDS = 900
_CSRC = Path(__file__).parent / "csrc"
# -fopenmp: ATen's parallel_for is a header template that only runs in parallel when the
# including code is built with OpenMP (without it the kernels ran on one thread). The
# process already has torch's libgomp loaded and the extension binds to that one (same
# soname), so the kernels and torch share one thread pool.
# -ffp-contract=off: a multiply and an add stay two roundings where the torch code a kernel
# replaces has two (the kernels that want fused multiply-adds use them explicitly).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
           "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]
_ext: ModuleType | None = None
load_error: str | None = None


def _sources() -> list[Path]:
    return sorted(_CSRC.glob("*.cpp"))


def load() -> ModuleType | None:
    """The compiled extension, building it on first use; None (and a warning) if that fails
    or if PAGEDLLM_CPU_KERNELS=0 asks for torch's ops only. Model and layer code reach the
    kernels through kernels/ops.py, never through this module."""
    global _ext, load_error
    if _ext is not None or load_error is not None:
        return _ext
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        load_error = "disabled by PAGEDLLM_CPU_KERNELS=0"
        logger.info("C++ CPU kernels %s: using torch's ops", load_error)
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        load_error = f"no C++ compiler ({compiler!r} is not on PATH; install g++ to build them)"
        logger.warning("C++ CPU kernels unavailable, using torch's ops (slower): %s", load_error)
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root
        from torch.utils.cpp_extension import load as build_and_load
        # The name carries the hash of the sources, their directory and the flags: each
        # checkout (worktrees, versions, a CI clone) gets its own build directory instead of
        # rebuilding a shared one in turn (ninja rebuilds when the source paths change: a
        # minute, silently, at the next model load).
        digest = hashlib.sha1(str(_CSRC.resolve()).encode())
        for src in [*_sources(), *sorted(_CSRC.glob("*.h"))]:
            digest.update(src.name.encode() + src.read_bytes())
        digest.update(repr((_CFLAGS, _LDFLAGS)).encode())
        name = f"pagedllm_cpu_ops_{digest.hexdigest()[:10]}"
        build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        if (build_dir / f"{name}.so").exists():
            logger.info("loading the C++ CPU kernels from %s", build_dir)
        else:
            logger.info("building the C++ CPU kernels for this machine (about a minute, once; "
                        "cached in %s)", build_dir)
        if not (build_dir / f"{name}.so").exists():  # (newer torch leaves its lock file)
            wait_for_other_builder(build_dir / "lock")
        _ext = build_and_load(name=name, sources=[str(s) for s in _sources()],
                              build_directory=str(build_dir), extra_cflags=_CFLAGS,
                              extra_ldflags=_LDFLAGS,
                              verbose=os.environ.get("PAGEDLLM_VERBOSE_BUILD") == "1")
    except Exception as e:  # no compiler, no ninja, ...: keep serving with torch's ops
        load_error = f"{type(e).__name__}: {e}"
        logger.warning("C++ CPU kernels unavailable, using torch's ops: %s", load_error)
    return _ext


def wait_for_other_builder(lock: Path) -> None:
    """Wait while another process builds the extension, but break a lock left by a builder
    that died (torch's own wait on it never ends, so every engine start would hang)."""
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            logger.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(1.0)


def main() -> int:
    """Build the kernels now, one line of progress per compiled file (scripts/setup.sh runs
    this, so the first request does not wait). Exit status 0 either way: without a compiler
    pagedllm still runs, on torch's ops, and this says so."""
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pagedllm.kernels import build; "
         "sys.exit(0 if build.load() is not None else 1)"],
        env={**os.environ, "PAGEDLLM_VERBOSE_BUILD": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    assert child.stdout is not None
    tail: list[str] = []
    for line in child.stdout:
        step = re.match(r"\[(\d+/\d+)\] .*?(?:-c (\S+)|-o (\S+\.so))", line)
        if step:
            what = f"compiling {Path(step[2]).name}" if step[2] else f"linking {step[3]}"
            print(f"pagedllm kernels: [{step[1]}] {what}", flush=True)
        tail = (tail + [line.rstrip()])[-30:]
    if child.wait() != 0:
        print("\n".join(tail), file=sys.stderr)
        print("pagedllm: the C++ CPU kernels could not be built (see above); pagedllm runs on "
              "torch's own ops, correct but slower. Install a C++ compiler (g++) and run "
              "`python -m pagedllm.kernels.build` again.", file=sys.stderr)
        return 0
    print(f"pagedllm kernels: ready ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
