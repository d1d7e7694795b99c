"""Linear weights kept as the GGUF stores them (quantization="gguf"): Q4_1, for the CPU
kernel csrc/q4_linear.cpp.

A Q4_1 block is 32 input features of one output, w = d * q + m with q in 0..15 and d, m
float16. The kernel computes with these exact values (what HF transformers and llama.cpp
dequantize), reading 5 bits a weight where bf16 weights take 16: one decode row streams
~66 MB of SmolLM2-135M's layers instead of ~212 MB. The activations stay bf16.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedllm.layers.linear import LinearBase, is_q4_1  # noqa: F401 (is_q4_1: re-exported)

BLOCK = 32          # input features per Q4_1 block
PANEL_GROUPS = 4    # output groups of 16 side by side in the packed layout
BLOCK_BYTES = 320   # one group's block: 256 bytes of quants, 16 d, 16 m (float16)


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
    packed Q4_1 weight as its packed_weight, in place of a bf16 copy; the linears changed.

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
            changed.append(module)
    return changed
