"""Linear weights kept as the GGUF stores them (quantization="gguf"): Q4_1, for the CPU
kernel csrc/q4_linear.cpp.

A Q4_1 block is 32 input features of one output, w = d * q + m with q in 0..15 and d, m
float16. The kernel computes with these exact values (what HF transformers and llama.cpp
dequantize), reading 5 bits a weight where bf16 weights take 16: one decode row streams
~66 MB of SmolLM2-135M's layers instead of ~212 MB. The activations stay bf16.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from pagedllm.kernels import ops, probes
from pagedllm.layers.linear import LinearBase, LinearLayer
from pagedllm.layers.linear_methods import LinearMethod, PackedBf16LinearMethod

logger = logging.getLogger(__name__)

BLOCK = 32          # input features per Q4_1 block
PANEL_GROUPS = 4    # output groups of 16 side by side in the packed layout
BLOCK_BYTES = 320   # one group's block: 256 bytes of quants, 16 d, 16 m (float16)


class GGUFQ4_1LinearMethod(LinearMethod):
    """x w^T from the packed Q4_1 weight (layer.packed_weight, set by attach_q4_1) at every
    row count; the layer's bf16 weight is freed."""

    owns_packing = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        y = ops.q4_1_linear_bf16(x, layer.packed_weight)
        return y if bias is None else y + bias


def is_q4_1(packed: torch.Tensor | None) -> bool:
    """Whether a packed weight is a GGUF Q4_1 weight (pack_q4_1's uint8 layout)."""
    return packed is not None and packed.dtype == torch.uint8


def can_pack_q4_1(out_features: int, in_features: int) -> bool:
    return out_features % (16 * PANEL_GROUPS) == 0 and in_features % BLOCK == 0


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The quants q (uint8 [N, K] in 0..15) and each block's d and m (float16 [N, K/32]) in
    the kernel's layout, uint8 [N/64, K/32, 4, 320]: for each panel of 4 groups of 16
    outputs, block by block, each group's 256 bytes of quants, then its 16 d, then its 16 m.

    The quants of a group's block are 4 runs of 32 16-bit words. Run u's word 2o + e holds,
    in its 4 nibbles s = 0..3, output o's element e of the input pair 4u + s: one 64-byte
    load gives the kernel 4 vectors of 16 pairs, in the lane order of a bf16 dot product."""
    n, k = q.shape
    if not can_pack_q4_1(n, k) or d.shape != (n, k // BLOCK) or m.shape != d.shape:
        raise ValueError(f"cannot pack a Q4_1 weight [{n}, {k}] with scales {list(d.shape)} "
                         f"and minimums {list(m.shape)}: need N a multiple of 64, K of 32")
    groups, blocks = n // 16, k // BLOCK
    # [group, output o, block, run u, nibble s, element e] -> [group, block, u, o, e, s]
    v = q.reshape(groups, 16, blocks, 4, 4, 2).permute(0, 2, 3, 1, 5, 4).to(torch.int32)
    words = v[..., 0] | (v[..., 1] << 4) | (v[..., 2] << 8) | (v[..., 3] << 12)
    quants = words.to(torch.int16).contiguous().view(torch.uint8).reshape(groups, blocks, 256)

    def per_block(s: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> [group, block, 32 bytes]
        return (s.to(torch.float16).reshape(groups, 16, blocks).permute(0, 2, 1).contiguous()
                .view(torch.uint8).reshape(groups, blocks, 32))

    per_group = torch.cat([quants, per_block(d), per_block(m)], 2)
    return per_group.reshape(groups // PANEL_GROUPS, PANEL_GROUPS, blocks, BLOCK_BYTES) \
        .transpose(1, 2).contiguous()


def attach_q4_1(model: nn.Module,
                weights: Iterable[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
                ) -> list[LinearBase]:
    """Give each linear whose checkpoint weights are all Q4_1 (merged ones: every shard) the
    packed Q4_1 weight as its packed_weight and the Q4_1 method; the linears changed.

    weights: (HF name, (q, d, m)) from ModelSource.q4_1_weights(), copied into place by the
    linear's own weight_loader (the same rows as its bf16 weight)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    parts: dict[str, list] = {}  # module name -> [module, q, d, m, rows filled]
    for name, (q, d, m) in weights:
        target, shard = name.removesuffix(".weight"), ()
        for ckpt, (merged, shard_id) in mapping.items():
            if f".{ckpt}." in name:
                target, shard = target.replace(ckpt, merged), (shard_id,)
                break
        module = modules.get(target)
        if not isinstance(module, LinearBase):
            continue
        if target not in parts:
            n, k = module.weight.shape
            parts[target] = [module, torch.empty(n, k, dtype=torch.uint8),
                             torch.empty(n, k // BLOCK, dtype=torch.float16),
                             torch.empty(n, k // BLOCK, dtype=torch.float16), 0]
        entry = parts[target]
        for buffer, loaded in zip(entry[1:4], (q, d, m)):
            module.weight_loader(buffer, loaded, *shard)
        entry[4] += q.shape[0]
    changed = []
    for module, q, d, m, rows in parts.values():
        n, k = module.weight.shape
        if rows == n and module.tp_size == 1 and can_pack_q4_1(n, k):
            module.packed_weight = pack_q4_1(q, d, m)
            module.linear_method = GGUFQ4_1LinearMethod()
            changed.append(module)
    return changed


def keep_q4_1(model: nn.Module,
              weights: Iterable[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
              ) -> None:
    """quantization="gguf": the linears whose GGUF weights are Q4_1 compute from them, kept
    quantized, and their bf16 weights and packings are freed; the bf16 LM head takes
    pagedllm's packed kernel everywhere (with AMX it was packed for oneDNN), for its fp32
    logits and the same kernel as on CPUs without AMX."""
    if not probes.has_packed_linear():
        raise ValueError("quantization=gguf needs the CPU kernels built with AVX512-BF16 "
                         "(this CPU or build has none)")
    before = {m: m.packed_weight for m in model.modules() if isinstance(m, LinearBase)}
    changed = attach_q4_1(model, weights)
    if not changed:
        raise ValueError("quantization=gguf: the model has no Q4_1 linear weights to keep "
                         "(only GGUF Q4_1 is kept quantized; other types are dequantized)")
    added = sum(m.packed_weight.nbytes for m in changed)
    freed = sum(m.weight.nbytes * (2 if before[m] is not None else 1) for m in changed)
    for m in changed:  # an empty tensor of its dtype: the Q4_1 method never reads it
        m.weight.data = torch.empty(0, dtype=m.weight.dtype)
    head = getattr(model, "lm_head", None)
    if (isinstance(head, LinearLayer) and head.weight.dtype == torch.bfloat16
            and not isinstance(head.linear_method, PackedBf16LinearMethod)
            and PackedBf16LinearMethod.can_pack(head.weight)):
        head.linear_method = PackedBf16LinearMethod(fp32_out=True)
        head.linear_method.process_weights_after_loading(head)
    logger.info("quantization gguf: %d of %d linears keep their Q4_1 weights (%.0f MiB, "
                "%.0f MiB of bf16 copies freed)", len(changed), len(before), added / 2**20,
                freed / 2**20)
