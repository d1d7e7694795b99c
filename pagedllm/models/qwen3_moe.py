"""Qwen3-MoE and Qwen2-MoE: the Llama decoder (Qwen3-MoE with q/k norms, Qwen2-MoE with
q/k/v biases) whose feed-forward block is, in the layers the config makes sparse, a router
choosing the top-k of E experts (layers/moe.py), plus, in Qwen2-MoE, a shared expert every
token passes through, scaled by a sigmoid gate.

Checkpoints hold each expert's projections as its own tensor, mlp.experts.{e}.gate_proj.
weight (transformers 4.x's names, which 5.x still writes though it holds the experts
stacked in memory); GGUF's stacked experts reach the model split per expert
(loader/gguf_loader.py).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.moe import FusedMoE
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import MLP, DecoderModel, LlamaForCausalLM

# mlp.experts.{e}.{gate,up,down}_proj.weight: one expert's projection
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class SparseMoeBlock(nn.Module):
    """The router (a replicated linear [E, H]), the routed experts and an optional shared
    expert whose output is scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig, weights_in_fp32: bool = False) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size,
                                config.norm_topk_prob, weights_in_fp32)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward(x, self.gate.forward(x))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate.forward(x))
            out = out + gate * self.shared_expert.forward(x)
        return out


def qwen_moe_mlp(config: ModelConfig, layer: int) -> nn.Module:
    return SparseMoeBlock(config) if config.is_moe_layer(layer) else MLP(config)


class QwenMoeDecoderModel(DecoderModel):
    """The Llama decoder with a sparse block in the layers config.is_moe_layer names."""

    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__(config, qk_norm, qwen_moe_mlp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    decoder_class = QwenMoeDecoderModel

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes(config)
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                for name in cls.mlp_shapes(f"model.layers.{i}.mlp.", 0, 0):  # the dense MLP's
                    del shapes[name]
                shapes.update(cls.moe_shapes(f"model.layers.{i}.", config))
        return shapes

    @classmethod
    def moe_shapes(cls, prefix: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors of the sparse block of the layer under prefix."""
        h, e, ffn = config.hidden_size, config.num_experts, config.moe_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {prefix + "mlp.gate.weight": (e, h)}
        for i in range(e):
            shapes.update(cls.mlp_shapes(f"{prefix}mlp.experts.{i}.", h, ffn))
        if config.shared_expert_intermediate_size:
            shapes.update(cls.mlp_shapes(prefix + "mlp.shared_expert.", h,
                                         config.shared_expert_intermediate_size))
            shapes[prefix + "mlp.shared_expert_gate.weight"] = (1, h)
        return shapes

    def weight_target(self, name: str) -> tuple[str, tuple[object, ...]]:
        if match := _EXPERT.fullmatch(name):
            experts, expert, part = match.groups()
            return f"{experts}.{'w2' if part == 'down' else 'w13'}", (int(expert), part)
        return super().weight_target(name)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: no q/k norms; q/k/v biases and the shared expert come from
    the config."""

    qk_norm = False
