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


class CustomOp(nn.Module):
    """forward_native is torch's ops (the reference, and what CUDA runs); forward_cpu is
    pagedllm's kernels, which fall back to forward_native for inputs they do not take.
    Which one is `forward` is decided once, when the layer is built."""

    def __init__(self) -> None:
        super().__init__()
        # an instance attribute: calls go straight to the chosen method, no per-call check
        self.forward = self.forward_cpu if uses_cpu_kernels() else self.forward_native

    def forward_native(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.forward_native(*args, **kwargs)
