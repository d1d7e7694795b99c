from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import cpu_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for a merged [..., 2 * intermediate] gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = cpu_ops.for_tensor(x) if x.dim() == 2 and x.stride(-1) == 1 else None
        if ext is not None:  # one fused C++ loop
            return ext.silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
