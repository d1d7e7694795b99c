"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention and weight mapping, with

- embeddings scaled by sqrt(hidden_size), rounded to the activation dtype (as HF does);
- RMSNorm scaling by 1 + weight (layers/layernorm.py's GemmaRMSNorm), four per layer: the
  attention's and the MLP's outputs are normed before they join the residual stream;
- a GeGLU MLP (tanh-approximated GELU);
- the attention scale query_pre_attn_scalar ** -0.5, and sliding-window layers interleaved
  with global ones (config.layer_types);
- Gemma 2: soft-capped attention scores and final logits;
- Gemma 3: q/k norms, and a rope base of its own (rope_local_theta, no scaling) on the
  sliding layers; the global layers take rope_theta and the rope scaling.

The layers keep the Llama decoder's convention of passing (x, residual) and adding the
residual inside the next norm, so each sum is the one HF computes, in the same order.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.layers.activation import GeluAndMul
from pagedllm.layers.embed_head import VocabParallelEmbedding
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import DecoderAttention, LlamaForCausalLM


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma's MLP takes gelu_pytorch_tanh, not {config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, qk_norm: bool,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DecoderAttention(config, layer, qk_norm, rotary_emb, GemmaRMSNorm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP block's normed output, the residual stream before it is added), over
        every token or, past the attention, the rows keep_rows indexes."""
        if residual is None:
            x, residual = self.input_layernorm.forward(x), x
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(positions, x, keep_rows)
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        x = self.post_attention_layernorm.forward(x)
        x, residual = self.pre_feedforward_layernorm.forward(x, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(x)), residual


def is_sliding_type(config: ModelConfig, layer: int) -> bool:
    """Whether a layer is of type sliding_attention (Gemma 3's take the local rope base,
    with or without a window)."""
    return config.layer_types is not None and config.layer_types[layer] == "sliding_attention"


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # HF's scale is an fp32 tensor cast to the weights' dtype (sqrt(3072) is 55.5 in bf16)
        scale = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32)
        self.embed_scale = float(scale.to(self.embed_tokens.weight.dtype))
        hd, max_pos = config.head_dim, config.max_position_embeddings
        global_rope = RotaryEmbedding(hd, max_pos, config.rope_theta, config.rope_scaling)
        local_rope = global_rope
        if config.rope_local_theta is not None:
            local_rope = RotaryEmbedding(hd, max_pos, config.rope_local_theta)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm,
                              local_rope if is_sliding_type(config, i) else global_rope)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: the embeddings scaled."""
        return self.embed_tokens.forward(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every token, or of the rows keep_rows indexes (see
        DecoderModel.forward)."""
        x, residual = self.embed(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # a call: fault injection hooks layers
            x, residual = layer(positions, x, residual, keep_rows if i == last else None)
        x, _ = self.norm.forward(x, residual)
        return x


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_class = GemmaModel

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes(config)
        for i in range(config.num_hidden_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{i}.{norm}.weight"] = (config.hidden_size,)
        return shapes

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
