"""Layers with a torch implementation and a C++ CPU one, chosen once (vLLM's CustomOp)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import probes


def uses_cpu_kernels() -> bool:
    """Whether layers built now take pagedllm's C++ kernels: they are built on the CPU (the
    default device; the model runner builds CUDA models under their device) and the
    kernels are available, vectorized for this CPU (probes.elementwise_vectorized)."""
    return (torch.get_default_device().type == "cpu" and probes.available()
            and probes.elementwise_vectorized())


def uses_cuda_kernels() -> bool:
    """Whether layers built now take pagedllm's Triton kernels for 16-bit activations
    (layers/triton_ops.py): they are built on CUDA and triton imports."""
    if torch.get_default_device().type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class CustomOp(nn.Module):
    """forward_native is torch's ops (the reference, and what fp32 runs on CUDA); forward_cpu
    is pagedllm's C++ kernels, forward_cuda its Triton kernels for 16-bit activations; both
    fall back to forward_native for inputs they do not take. Which one is `forward` is
    decided once, when the layer is built."""

    def __init__(self) -> None:
        super().__init__()
        # an instance attribute: calls go straight to the chosen method, no per-call check
        if uses_cpu_kernels():
            self.forward = self.forward_cpu
        elif uses_cuda_kernels():
            self.forward = self.forward_cuda
        else:
            self.forward = self.forward_native

    def forward_native(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.forward_native(*args, **kwargs)
