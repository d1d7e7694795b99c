"""CPU paged attention with a C++ kernel that reads the KV blocks in place.

torch_native's decode gathers every sequence's whole padded context out of the cache in
every layer of every step (a full copy of the live KV cache per step); this kernel walks
the block tables instead. It is compiled with torch.utils.cpp_extension on first use
(cached afterwards under TORCH_EXTENSIONS_DIR); if that fails the engine falls back to
torch_native, which stays the reference.

Per row of the batch (num cached tokens, num new tokens): rows with few new tokens
(decodes, short chunks over a cached prefix) take the kernel; a prompt with nothing cached
takes torch's flash attention over its own new tokens; a long chunk over a cached prefix
gathers its context once and takes torch's SDPA (the gather is amortised over the chunk).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.attention import torch_native
from pagedllm.attention.context import Context

logger = logging.getLogger(__name__)

# Rows with at most this many new tokens over a cached prefix run in the kernel.
MAX_KERNEL_QUERY_LEN = 32
# A build lock older than this belongs to a builder that died (a build takes ~1 min).
STALE_LOCK_SECONDS = 900
_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# -fopenmp: ATen's parallel_for is a header template that only runs in parallel when the
# including code is built with OpenMP (without it the kernel ran on one thread). The
# process already has torch's libgomp loaded, and the extension binds to that one (same
# soname), so kernel and torch share one thread pool.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
_LDFLAGS = ["-fopenmp"]
_ext: ModuleType | None = None
_load_error: str | None = None


def load_extension() -> ModuleType | None:
    """The compiled kernel, building it on first use; None (and a warning) if that fails."""
    global _ext, _load_error
    if _ext is not None or _load_error is not None:
        return _ext
    try:
        from torch.utils.cpp_extension import get_default_build_root, load
        logger.info("loading the C++ paged-attention kernel (compiled once, then cached)")
        # The name carries the hash of source and flags: checkouts with different kernels
        # (worktrees, versions) each get their own build directory instead of rebuilding
        # one in turn.
        digest = hashlib.sha1(_SOURCE.read_bytes() + repr((_CFLAGS, _LDFLAGS)).encode()
                              ).hexdigest()[:10]
        name = f"pagedllm_cpu_paged_attention_{digest}"
        build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        _wait_for_other_builder(build_dir / "lock")
        _ext = load(name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                    extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                    verbose=os.environ.get("PAGEDLLM_VERBOSE_BUILD") == "1")
    except Exception as e:  # no compiler, no ninja, ...: keep serving with torch_native
        _load_error = f"{type(e).__name__}: {e}"
        logger.warning("C++ paged attention unavailable, using torch_native: %s", _load_error)
    return _ext


def _wait_for_other_builder(lock: Path) -> None:
    """Wait while another process builds the kernel, but break a lock left by a builder
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


def is_available() -> bool:
    return load_extension() is not None


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                    q_lens: torch.Tensor, k_lens: torch.Tensor, scale: float) -> None:
    """Write into out the causal attention of rows' new tokens over their paged K/V.

    Row i's q_lens[i] tokens sit at q[q_starts[i]:] and follow k_lens[i] - q_lens[i] cached
    tokens; all k_lens[i] K/V vectors (the new ones too) are already in the cache.
    """
    ext = load_extension()
    assert ext is not None, "the C++ paged-attention kernel is not available"
    ext.paged_attention(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     ctx: Context, scale: float) -> torch.Tensor:
    """One new token per row (the first len(q) rows of the context)."""
    assert ctx.block_tables is not None and ctx.context_lens is not None
    n = q.shape[0]
    out = torch.empty_like(q)
    ones = torch.ones(n, dtype=torch.int64)
    paged_attention(out, q, k_cache, v_cache, ctx.block_tables[:n], torch.arange(n), ones,
                    ctx.context_lens[:n], scale)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, ctx: Context, scale: float,
                      first_row: int = 0) -> torch.Tensor:
    """Rows first_row.. of the context, their new tokens packed in q, k, v."""
    assert ctx.seqlens_q is not None and ctx.seqlens_k is not None
    out = torch.empty_like(q)
    kernel_rows: list[tuple[int, int, int, int]] = []   # (row, q_start, q_len, k_len)
    start = 0
    for i in range(first_row, len(ctx.seqlens_q)):
        len_q, len_k = ctx.seqlens_q[i], ctx.seqlens_k[i]
        end = start + len_q
        if len_k == len_q:
            out[start:end] = torch_native._sdpa(q[start:end], k[start:end], v[start:end], scale,
                                                causal=True)
        elif len_q <= MAX_KERNEL_QUERY_LEN:
            kernel_rows.append((i, start, len_q, len_k))
        else:
            assert ctx.block_tables is not None
            out[start:end] = torch_native.cached_prefix_attention(
                q[start:end], k_cache, v_cache, ctx.block_tables[i], len_k, scale)
        start = end
    if kernel_rows:
        assert ctx.block_tables is not None
        rows, q_starts, q_lens, k_lens = (torch.tensor(c, dtype=torch.int64)
                                          for c in zip(*kernel_rows))
        paged_attention(out, q, k_cache, v_cache, ctx.block_tables[rows].contiguous(), q_starts,
                        q_lens, k_lens, scale)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
    """Same contract as torch_native.attention."""
    if not k_cache.numel():  # no cache bound (profiling runs): nothing to read in place
        return torch_native.attention(q, k, v, k_cache, v_cache, ctx, scale)
    torch_native.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    q = q.contiguous()
    if not ctx.is_prefill:
        return decode_attention(q, k_cache, v_cache, ctx, scale)
    num_decodes = ctx.num_decodes  # a mixed batch (chunked prefill): decode rows come first
    if num_decodes == 0:
        return prefill_attention(q, k, v, k_cache, v_cache, ctx, scale)
    return torch.cat([decode_attention(q[:num_decodes], k_cache, v_cache, ctx, scale),
                      prefill_attention(q[num_decodes:], k[num_decodes:], v[num_decodes:],
                                        k_cache, v_cache, ctx, scale, first_row=num_decodes)])
