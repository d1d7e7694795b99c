"""Build a model from a checkpoint's weights: construct it in its dtype on its device, copy
the weights in, let each linear pick its method once (layers/linear_methods.py), keep GGUF
Q4_1 weights quantized where asked, and put the CPU weights on 2 MiB pages."""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from pagedllm import memory
from pagedllm.kernels import ops
from pagedllm.layers.linear import LinearLayer
from pagedllm.layers.moe import FusedMoE
from pagedllm.layers.quantized import keep_q4_1
from pagedllm.models.config import ModelConfig
from pagedllm.models.registry import model_class

logger = logging.getLogger(__name__)

Q4_1Weights = Iterable[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


def build_model(mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                weights: Iterable[tuple[str, torch.Tensor]],
                q4_1_weights: Q4_1Weights | None = None, log: bool = True) -> nn.Module:
    """The model with its weights loaded and processed, in eval mode.
    q4_1_weights (quantization="gguf"): ModelSource.q4_1_weights(), kept quantized."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:  # layers choose their CPU or torch implementation as they are built
            model = model_class(mc)(mc)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(weights)  # type: ignore[operator]
    model.eval()
    process_weights_after_loading(model, log)
    if q4_1_weights is not None:
        keep_q4_1(model, q4_1_weights)
    if device.type == "cpu":
        moved = move_weights_to_huge_pages(model)
        if moved and log:
            logger.info("weights on 2 MiB pages: %.0f MiB", moved / 2**20)
    return model


def process_weights_after_loading(model: nn.Module, log: bool = True) -> None:
    """Each linear layer picks its method for its loaded weight, which may pack it; each
    MoE layer picks how its experts' projections are computed."""
    layers = [m for m in model.modules() if isinstance(m, LinearLayer)]
    for layer in layers:
        layer.process_weights_after_loading()
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
        moe.process_weights_after_loading()
    packed = [m for m in layers if m.packed_weight is not None]
    ours = sum(m.linear_method.owns_packing for m in packed)
    if packed and log:
        logger.info("weights also kept packed for bf16 matmuls (%d for pagedllm's kernel, "
                    "%d for oneDNN): +%.0f MiB", ours, len(packed) - ours,
                    sum(m.weight.nbytes for m in packed) / 2**20)


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """The parameters and pagedllm's packings copied onto 2 MiB pages; oneDNN's packings
    (opaque memory, as many bytes as their weights) collapsed onto them in place. The bytes
    moved."""
    layers = [m for m in model.modules()
              if isinstance(m, LinearLayer) and m.packed_weight is not None]
    ours = [m.packed_weight for m in layers if m.linear_method.owns_packing]
    moved = memory.move_to_huge_pages(list(model.parameters()) + ours)
    moved += memory.collapse_to_huge_pages(
        [(ops.onednn_data_ptr(m.packed_weight), m.weight.nbytes)
         for m in layers if not m.linear_method.owns_packing])
    return moved
