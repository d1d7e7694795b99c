"""Build a model from a checkpoint's weights: construct it in its dtype on its device, copy
the weights in (GGUF weights kept quantized go to layers/quantized.py instead), let each
linear pick its method once (layers/linear_methods.py), and put the CPU weights on 2 MiB
pages.

Each linear then holds its weight in one form (plain, packed with the plain one freed, or
a GGUF's blocks; two only for oneDNN's packing on AVX512-BF16 CPUs), and an embedding tied
to the LM head reads the head's form: resident weight memory is the checkpoint's size in
the run's form (resident_line says how close)."""
from __future__ import annotations

import logging
import os
from typing import Iterable

import torch
from torch import nn

from pagedllm import memory
from pagedllm.kernels import ops
from pagedllm.layers import quantized
from pagedllm.layers.embed_head import VocabParallelEmbedding
from pagedllm.layers.linear import LinearLayer
from pagedllm.layers.moe import FusedMoE
from pagedllm.loader.validate import weight_numel
from pagedllm.models.config import ModelConfig
from pagedllm.models.registry import model_class

logger = logging.getLogger(__name__)


def build_model(mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                weights: Iterable[tuple[str, torch.Tensor | quantized.GGUFWeight]],
                log: bool = True) -> nn.Module:
    """The model with its weights loaded and processed, in eval mode. GGUFWeights among the
    weights (ModelSource.weights with types to keep) stay quantized."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:  # layers choose their CPU or torch implementation as they are built
            model = model_class(mc)(mc)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(weights)  # type: ignore[operator]
    model.eval()
    keep_gguf_weights(model, log)
    process_weights_after_loading(model, log)
    if device.type == "cpu":
        moved = move_weights_to_huge_pages(model)
        if moved and log:
            logger.info("weights on 2 MiB pages: %.0f MiB", moved / 2**20)
        memory.release_free_memory()
    return model


def keep_gguf_weights(model: nn.Module, log: bool = True) -> None:
    """Pack the GGUF weights the layers and experts gathered (quantization="gguf"); an LM
    head tied to an embedding kept quantized computes from the embedding's packing."""
    layers = [m for m in model.modules() if getattr(m, "gguf_rows", None) is not None]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE) and m.gguf_gathered]
    if not layers and not experts:
        return
    kept = [m for m in layers
            if quantized.finish_gguf(m, fp32_out=isinstance(m, LinearLayer) and m.fp32_out)]
    memory.release_free_memory()
    kept_experts = []
    for m in experts:  # an expert block's bytes (~370 MB at Qwen3-30B-A3B) freed as we go
        if m.finish_gguf():
            kept_experts.append(m)
        memory.release_free_memory()
    head = getattr(model, "lm_head", None)
    for embed in (m for m in model.modules() if isinstance(m, VocabParallelEmbedding)):
        if (embed.gguf_parts is not None and head is not None and head is not embed
                and head.weight is embed.weight):
            head.gguf_parts = embed.gguf_parts
            head.linear_method = quantized.GGUFLinearMethod(fp32_out=head.fp32_out)
    if log:
        types = sorted({p.qtype.name for p in quantized.model_parts(model)})
        logger.info("GGUF weights kept quantized in %d of %d layers and %d of %d expert "
                    "blocks (%s): %.0f MiB", len(kept), len(layers), len(kept_experts),
                    len(experts), ", ".join(types), quantized.packed_bytes(model) / 2**20)


def decode_read_bytes(model: nn.Module, every_expert: bool = False) -> int:
    """Weight bytes one decode token reads: every linear's weight in the form its method
    computes from (a GGUF packing, a bf16 weight), a tied head's once, and of each MoE
    layer's experts the share a token routes to (top_k of them), or all of them where
    every_expert (what the weights take, as a file's size counts them)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, LinearLayer):
            tensors = [p.packed for p in m.gguf_parts] if m.gguf_parts is not None \
                else [m.packed_weight if m.packed_weight is not None
                      and m.linear_method.owns_packing else m.weight]
            for t in tensors:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.nbytes
        elif isinstance(m, FusedMoE):
            experts = (sum(p.packed.nbytes for w13, w2 in m.gguf_experts for p in w13 + w2)
                       if m.gguf_experts is not None else m.w13.nbytes + m.w2.nbytes)
            total += experts if every_expert else experts * m.top_k // m.num_experts
    return total


def linear_kernels(model: nn.Module) -> str:
    """Which kernel each weight type's linears take, e.g. "196 Q4_K and 28 Q6_K on pagedllm
    gguf_linear (avx512_bf16); 1 bfloat16 on pagedllm packed bf16"."""
    counts: dict[str, dict[str, int]] = {}
    for m in model.modules():
        if isinstance(m, LinearLayer):
            types = ([p.qtype.name for p in m.gguf_parts] if m.gguf_parts is not None
                     else [str(m.weight.dtype).removeprefix("torch.")])
            per_kernel = counts.setdefault(m.linear_method.kernel, {})
            for t in types:
                per_kernel[t] = per_kernel.get(t, 0) + 1
    return "; ".join(" and ".join(f"{n} {t}" for t, n in sorted(types.items()))
                     + f" on {kernel}" for kernel, types in counts.items())


def process_weights_after_loading(model: nn.Module, log: bool = True) -> None:
    """Each linear layer picks its method for its loaded weight, which may pack it; each
    MoE layer picks how its experts' projections are computed. (Layers computing from a
    GGUF weight kept quantized have their method.)"""
    layers = [m for m in model.modules()
              if isinstance(m, LinearLayer) and m.gguf_parts is None]
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
    ours += [p.packed for p in quantized.model_parts(model)]
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
