"""Mixtral: the Llama decoder with a mixture of experts (top-2 of 8, the two weights
renormalised) in every layer. Its checkpoints name the block block_sparse_moe and an
expert's gate, down and up projections w1, w2 and w3; llama.cpp converts it as "llama"
with an expert count (so its Q/K rows come permuted, as Llama's)."""
from __future__ import annotations

import re

from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import DecoderModel
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock

_PARTS = {"w1": "gate", "w2": "down", "w3": "up"}
# block_sparse_moe.experts.{e}.w{1,2,3}.weight
_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def mixtral_moe(config: ModelConfig, layer: int) -> nn.Module:
    # HF scales the experts' outputs by the fp32 routing weights
    return SparseMoeBlock(config, weights_in_fp32=True)


class MixtralDecoderModel(DecoderModel):
    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__(config, qk_norm, mixtral_moe)


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    decoder_class = MixtralDecoderModel

    @classmethod
    def moe_shapes(cls, prefix: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, ffn = config.hidden_size, config.moe_intermediate_size
        block = prefix + "block_sparse_moe."
        shapes: dict[str, tuple[int, ...]] = {block + "gate.weight": (config.num_experts, h)}
        for e in range(config.num_experts):
            shapes.update({f"{block}experts.{e}.w1.weight": (ffn, h),
                           f"{block}experts.{e}.w3.weight": (ffn, h),
                           f"{block}experts.{e}.w2.weight": (h, ffn)})
        return shapes

    def weight_target(self, name: str) -> tuple[str, tuple[object, ...]]:
        if match := _EXPERT.fullmatch(name):
            layer, expert, w = match.groups()
            part = _PARTS[w]
            return f"{layer}.mlp.experts.{'w2' if part == 'down' else 'w13'}", (int(expert), part)
        return super().weight_target(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
