"""Fused elementwise kernels for bf16 / fp16 activations on CUDA, in Triton: RMSNorm (with
the residual add), SiLU-and-mul, and the rotary embedding in place (seed 002's fused ops,
nano-vllm's torch.compile'd layers).

A decode step of a 0.6B model runs ~50 small kernels a layer through torch's ops (an RMSNorm
alone is seven); in a CUDA graph each still costs a few microseconds, and at batch 1 those
microseconds are the step. Each kernel here rounds where the torch ops it replaces round
(every intermediate the 16-bit torch ops would store in 16 bits is rounded to 16 bits
here too), so outputs differ from them only by the order of the RMSNorm row sum.
fp32 keeps torch's ops: its greedy outputs are held to HF's token for token.
Imported only on CUDA; tested on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def takes(x: torch.Tensor) -> bool:
    """Whether these kernels take x: 16-bit, on CUDA (or under the interpreter, for tests)."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_s0, x_s1, res_s0,
                     heads, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = row // heads
    h = row % heads
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + t.to(tl.int64) * x_s0 + h * x_s1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t.to(tl.int64) * res_s0 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)       # x + residual, rounded
        tl.store(res_out_ptr + row.to(tl.int64) * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)                  # x.to(dtype) in torch
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * n + offs, (w * normed).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Llama's RMSNorm of x's last dim ([T, D], or [T, heads, D] normed head by head), or
    with a residual ([T, D]): (norm(x + residual), x + residual). New contiguous outputs."""
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
            x.stride(1) if x.dim() == 3 else 0, residual.stride(0) if residual is not None else 0,
            heads, n, eps, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_s0, d, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    base = x_ptr + row.to(tl.int64) * x_s0
    g = tl.load(base + offs, mask=mask, other=0.0)
    u = tl.load(base + d + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)      # F.silu, rounded
    tl.store(out_ptr + row.to(tl.int64) * d + offs, (s * u.to(tl.float32)).to(g.dtype),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] of a [T, 2d] gate/up output."""
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](x, out, x.stride(0), d,
                                                                  BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, x_s0, x_s1, heads,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = x_ptr + t.to(tl.int64) * x_s0 + h * x_s1
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    # the caches hold [cos(f), cos(f)] per position (rotate_half layout): the first half
    c = tl.load(cos_ptr + pos * (2 * HALF) + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * (2 * HALF) + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, each product and the sum rounded to dtype
    a1 = (x1f * c).to(dtype).to(tl.float32)
    b1 = (-x2f * s).to(dtype).to(tl.float32)
    a2 = (x2f * c).to(dtype).to(tl.float32)
    b2 = (x1f * s).to(dtype).to(tl.float32)
    tl.store(base + offs, (a1 + b1).to(dtype), mask=mask)
    tl.store(base + HALF + offs, (a2 + b2).to(dtype), mask=mask)


def rotary_(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
            sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (rows of D contiguous) rotated in place by its positions [T] with
    fp32 caches [max_position, D]; returns x."""
    tokens, heads, d = x.shape
    if tokens:
        _rotary_kernel[(tokens, heads)](x, positions, cos_cache, sin_cache, x.stride(0),
                                        x.stride(1), heads, HALF=d // 2,
                                        BLOCK=triton.next_power_of_2(d // 2), num_warps=1)
    return x
