"""The fused Triton kernels of 16-bit activations on CUDA (layers/triton_ops.py), run by the
Triton interpreter on CPU tensors, against the torch ops they replace: in fp16 the rotary
embedding bit for bit, SiLU-and-mul and RMSNorm within a rounding (RMSNorm sums its row in
another order, silu's exp is Triton's); fp32 is left to torch. The interpreter converts fp32
to bf16 by truncation (the GPU rounds to nearest), so bf16 is held to a few last-bit
differences here; tests/gpu/test_triton_kernels.py holds bf16 to the fp16 standard."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run in numpy

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from pagedllm.layers import triton_ops  # noqa: E402
from pagedllm.layers.activation import SiluAndMul  # noqa: E402
from pagedllm.layers.layernorm import RMSNorm  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402


def one_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp16: equal but for a last-bit difference here and there; bf16 (truncated by the
    interpreter at each rounding): within four of its last bits."""
    assert not out.isnan().any() and out.dtype == ref.dtype
    if out.dtype == torch.float16:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -9, atol=1e-6)
        assert (out == ref).float().mean() > 0.9
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -5, atol=2 ** -5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    norm = norm.to(dtype)
    x = torch.randn(7, 96, generator=g).to(dtype) * 3
    residual = torch.randn(7, 96, generator=g).to(dtype)
    one_rounding(norm.forward_cuda(x), norm.forward_native(x))
    out, res = norm.forward_cuda(x, residual)
    ref_out, ref_res = norm.forward_native(x, residual)
    if dtype == torch.float16:
        assert torch.equal(res, ref_res)       # x + residual, rounded once, both ways
    one_rounding(res, ref_res)
    one_rounding(out, ref_out)
    # Qwen3's q/k norm: heads of a strided view of the qkv output, normed head by head
    qkv = torch.randn(5, 4 * 32 + 64, generator=g).to(dtype)
    q = qkv[:, :128].view(5, 4, 32)
    head_norm = RMSNorm(32).to(dtype)
    one_rounding(head_norm.forward_cuda(q), head_norm.forward_native(q))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 2 * 1500, generator=g) * 4).to(dtype)   # two column tiles
    one_rounding(SiluAndMul().forward_cuda(x), SiluAndMul().forward_native(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 512, 10000.0)
    qkv = torch.randn(9, (6 + 2) * 64 + 2 * 64, generator=g).to(dtype)
    qk = qkv[:, :8 * 64].view(9, 8, 64)            # q and k heads of the qkv output, in place
    positions = torch.tensor([0, 1, 2, 100, 101, 7, 511, 3, 4])
    ref = rope.rotate_native(positions, qk.clone())
    out = rope.rotate_cuda(positions, qk)
    assert out.data_ptr() == qk.data_ptr()
    if dtype == torch.float16:
        assert torch.equal(out, ref)
    else:
        one_rounding(out, ref)


def test_fp32_keeps_torch():
    x = torch.randn(3, 32)
    norm = RMSNorm(32)
    assert not triton_ops.takes(x)
    assert torch.equal(norm.forward_cuda(x), norm.forward_native(x))
