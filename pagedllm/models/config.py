"""The model hyper-parameters every loader produces and every model reads."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


LAYER_TYPES = ("full_attention", "sliding_attention")


def pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every pattern-th layer global, the others sliding: HF's 4.x sliding_window_pattern
    (Gemma 3; Gemma 2 alternates, a pattern of 2) and llama.cpp's swa pattern. A pattern of
    1 makes every layer global; llama.cpp's 0, every layer sliding."""
    if pattern < 0:
        raise ValueError(f"a sliding window pattern must be >= 0, got {pattern}")
    return ["sliding_attention" if pattern == 0 or (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


@dataclass
class ModelConfig:
    """Architecture and hyper-parameters of a decoder-only transformer (HF names)."""

    architecture: str  # a key of models/registry.py's MODELS, e.g. "llama", "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v and o (Llama's option)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    # Attention windows: a layer of type "sliding_attention" attends to its last
    # sliding_window tokens (the new one included); None means every layer is global.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims (Phi-3)
    # Gemma 2/3: the attention scale is query_pre_attn_scalar ** -0.5 (else head_dim's);
    # soft-capping maps a score s to cap * tanh(s / cap); sliding layers' rope base
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    # Mixture of experts (0 experts: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding pairs), got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers, but there "
                                 f"are {self.num_hidden_layers}")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unknown layer types {sorted(unknown)} (known: {', '.join(LAYER_TYPES)})")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] "
                             f"and give an even number of rotary dims of head_dim {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts:
            self._check_experts()

    def _check_experts(self) -> None:
        for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts} (the number "
                             f"of experts), got {self.num_experts_per_tok!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must not be negative, got "
                             f"{self.shared_expert_intermediate_size}")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of a layer (None: it sees the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer has a window: KV blocks out of it can be freed."""
        return all(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)
