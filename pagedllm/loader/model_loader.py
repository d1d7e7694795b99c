"""Build a model from a checkpoint's weights: construct it in its dtype on its device, copy
the weights in, keep GGUF Q4_1 weights quantized where asked, let every other linear pick
its method once (layers/linear_methods.py), and put the CPU weights on 2 MiB pages.

Each linear then holds its weight in one form (plain, or packed with the plain one freed;
two only for oneDNN's packing on AVX512-BF16 CPUs), and an embedding tied to the LM head
reads the head's form: resident weight memory is the checkpoint's size in the run's dtype
(resident_line says how close)."""
from __future__ import annotations

import logging
import os
from typing import Iterable

import torch
from torch import nn

from pagedllm import memory
from pagedllm.kernels import ops
from pagedllm.layers.embed_head import VocabParallelEmbedding
from pagedllm.layers.linear import LinearLayer
from pagedllm.layers.moe import FusedMoE
from pagedllm.layers.quantized import keep_q4_1
from pagedllm.loader.validate import weight_numel
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
    if q4_1_weights is not None:  # first: these linears keep the GGUF's form, not a packing
        keep_q4_1(model, q4_1_weights)
    process_weights_after_loading(model, log)
    if device.type == "cpu":
        moved = move_weights_to_huge_pages(model)
        if moved and log:
            logger.info("weights on 2 MiB pages: %.0f MiB", moved / 2**20)
        memory.release_free_memory()
    return model


def process_weights_after_loading(model: nn.Module, log: bool = True) -> None:
    """Each linear layer picks its method for its loaded weight, which may pack it; each
    MoE layer picks how its experts' projections are computed."""
    layers = [m for m in model.modules() if isinstance(m, LinearLayer)]
    for layer in layers:
        layer.process_weights_after_loading()
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
        moe.process_weights_after_loading()
    tie_embeddings(model, layers)
    twice = [m for m in layers if m.packed_weight is not None and m.weight.numel()]
    if twice and log:
        logger.info("%d linears keep their plain weight beside oneDNN's packing (the CPU's "
                    "small-row kernels read it): +%.0f MiB", len(twice),
                    sum(m.weight.nbytes for m in twice) / 2**20)


def tie_embeddings(model: nn.Module, layers: list[LinearLayer]) -> None:
    """Each embedding that shares its weight with a linear layer (tied embeddings and LM
    head) takes its rows from that layer's form of the weight, which may be packed only."""
    owners = {id(m.weight): m for m in layers}  # type: ignore[attr-defined]
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, LinearLayer):
            head = owners.get(id(module.weight))
            if head is not None:
                module.tied_rows = head.embedding_rows


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """The parameters and pagedllm's packings copied onto 2 MiB pages; oneDNN's packings
    (opaque memory, as many bytes as their weights) collapsed onto them in place. The bytes
    moved."""
    layers = [m for m in model.modules()
              if isinstance(m, LinearLayer) and m.packed_weight is not None]
    ours = [m.packed_weight for m in layers if m.linear_method.owns_packing]
    moved = memory.move_to_huge_pages(list(model.parameters()) + ours)
    moved += memory.collapse_to_huge_pages(
        [(ops.onednn_data_ptr(m.packed_weight), m.packed_weight.numel() * 2)
         for m in layers if not m.linear_method.owns_packing])
    return moved


def resident_line(model: nn.Module, mc: ModelConfig, dtype: torch.dtype, path: str,
                  fmt: str, tp_size: int = 1) -> str:
    """What the load log says of the weights' memory: the bytes the model's tensors hold
    (memory.resident_bytes) against the checkpoint in bf16 (per rank: divided by the
    ranks) and, for a GGUF, against the file."""
    resident = memory.resident_bytes(model)
    bf16 = weight_numel(mc) * 2 / tp_size
    rank = " per rank" if tp_size > 1 else ""
    line = f"weights: {resident / 2**20:,.0f} MiB resident{rank} ({resident / bf16:.2f}x the "
    if fmt != "gguf":
        return line + f"bf16 checkpoint; {str(dtype).removeprefix('torch.')})"
    file = os.path.getsize(path) / tp_size
    return line + (f"model in bf16, {resident / file:.2f}x the {file / 2**20:,.0f} MiB GGUF "
                   f"file; {str(dtype).removeprefix('torch.')})")
