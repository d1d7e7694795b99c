from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import ops
from pagedllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(gate) * up for a merged [..., 2 * intermediate] gate/up projection."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The same in one fused C++ loop."""
        if x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x)
        return ops.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """The same in one Triton kernel for 16-bit activations (layers/triton_ops.py)."""
        from pagedllm.layers import triton_ops
        if x.dim() != 2 or not triton_ops.takes(x):
            return self.forward_native(x)
        return triton_ops.silu_and_mul(x)


class GeluAndMul(CustomOp):
    """gelu(gate) * up, GELU's tanh approximation (Gemma's GeGLU, HF's gelu_pytorch_tanh)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.gelu(gate, approximate="tanh") * up
