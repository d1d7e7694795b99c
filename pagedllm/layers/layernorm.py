"""RMSNorm, with the residual add fused in (seed 002); Gemma's variant, which scales by
1 + weight. On the CPU both take one C++ loop (kernels/csrc/elementwise.cpp rms_norm)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import ops
from pagedllm.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The same in one fused C++ loop. A 3-D x (Qwen3's q/k heads [T, heads, D]) is
        normed head by head, into a copy."""
        if x.dim() == 3 and residual is None and self.weight.dtype == x.dtype:
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight,
                                self.eps)[0].view(x.shape)
        if x.dim() != 2 or x.stride(-1) != 1 or self.weight.dtype != x.dtype:
            return self.forward_native(x, residual)
        if residual is None:
            return ops.rms_norm(x, None, self.weight, self.eps)[0]
        out, residual = ops.rms_norm(x, residual, self.weight, self.eps)
        return out, residual


    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The same in one Triton kernel for 16-bit activations (layers/triton_ops.py)."""
        from pagedllm.layers import triton_ops
        if (not triton_ops.takes(x) or self.weight.dtype != x.dtype or x.dim() not in (2, 3)
                or (residual is not None and (x.dim() != 2 or residual.stride(-1) != 1))):
            return self.forward_native(x, residual)
        return triton_ops.rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(CustomOp):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the product is taken
    in fp32 before rounding once to the input's dtype (as HF's Gemma2/Gemma3RMSNorm; Llama's
    rounds the normalised x first). In bf16, 1 + weight itself would lose the small
    offsets, so it is never stored in the activation dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The same in one fused C++ loop for bf16 (fp32 keeps torch's ops, HF's own). A
        3-D x (Gemma 3's q/k heads [T, heads, D]) is normed head by head, into a copy."""
        if x.dtype != torch.bfloat16 or self.weight.dtype != x.dtype:
            return self.forward_native(x, residual)
        if x.dim() == 3 and residual is None:
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps,
                                unit_offset=True)[0].view(x.shape)
        if x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x, residual)
        if residual is None:
            return ops.rms_norm(x, None, self.weight, self.eps, unit_offset=True)[0]
        out, residual = ops.rms_norm(x, residual, self.weight, self.eps, unit_offset=True)
        return out, residual
