"""The fused Triton kernels of 16-bit activations (layers/triton_ops.py) on the GPU against
the torch ops they replace, in bf16 and fp16: the rotary embedding and the residual add bit
for bit; RMSNorm (its row summed in another order) and SiLU-and-mul (Triton's exp) within
one rounding. Skipped without a GPU (conftest.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


def within_one_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and not out.isnan().any()
    ulp = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=1e-6)
    assert (out == ref).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ops_match_torch_on_the_gpu(dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        norm = RMSNorm(1024, eps=1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        norm = norm.to(dtype)
        assert norm.forward == norm.forward_cuda
        x, residual = torch.randn(64, 1024, dtype=dtype) * 3, torch.randn(64, 1024, dtype=dtype)
        within_one_rounding(norm(x), norm.forward_native(x))
        out, res = norm(x, residual)
        ref_out, ref_res = norm.forward_native(x, residual)
        assert torch.equal(res, ref_res)
        within_one_rounding(out, ref_out)
        qkv = torch.randn(33, 16 * 128 + 2 * 8 * 128, dtype=dtype)
        q = qkv[:, :16 * 128].view(33, 16, 128)
        head_norm = RMSNorm(128).to(dtype)
        within_one_rounding(head_norm(q), head_norm.forward_native(q))
        act = SiluAndMul()
        gate_up = torch.randn(64, 2 * 3072, dtype=dtype) * 4
        within_one_rounding(act(gate_up), act.forward_native(gate_up))
        rope = RotaryEmbedding(128, 4096, 1000000.0)
        positions = torch.randint(0, 4096, (33,))
        qk = qkv[:, :24 * 128].view(33, 24, 128)
        ref = rope.rotate_native(positions, qk.clone())
        assert rope.rotate == rope.rotate_cuda
        assert torch.equal(rope.rotate(positions, qk), ref)
