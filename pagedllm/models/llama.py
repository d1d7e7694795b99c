"""Llama-family decoder: Llama 2/3 and SmolLM2; with per-layer windows, Mistral; with q/k/v
biases, Qwen2 / Qwen2.5; with q/k norms, Qwen3 (models/qwen3.py). Other families reuse its
parts (models/phi3.py, models/gemma.py).

Inside a layer, submodules are run through .forward(): nn.Module.__call__'s hook handling
costs about 1 ms of a 16 ms single-stream decode step (12 calls x 30 layers, measured), and
no hooks are set on them. Layers themselves are called normally (fault injection hooks one).
On the CPU a bf16 decode step may instead run these layers as one C++ call
(engine/cpu_decode_stack.py), with the same kernels in the same order.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from pagedllm.layers.quantized import GGUFWeight, take_gguf
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.config import ModelConfig


def _copy_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, qk_norm: bool,
                 rotary_emb: RotaryEmbedding, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        hd = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads,
                                          bias=config.attention_bias or config.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.head_dim = hd
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=config.attention_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, hd, config.attention_scale, self.num_kv_heads,
                              config.layer_window(layer), config.attn_logit_softcapping)
        self.q_norm = norm(hd, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(hd, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output for every token of x, or for the rows keep_rows
        indexes (every token's k and v are still computed and cached)."""
        qkv = self.qkv_proj.forward(x)
        if self.q_norm is None:  # q and k heads are adjacent in qkv: rotate them in one go
            qk, v = qkv.split_with_sizes([self.q_size + self.kv_size, self.kv_size], -1)
            qk = self.rotary_emb.rotate(positions, qk.view(-1, self.num_heads + self.num_kv_heads,
                                                           self.head_dim))
            q, k = qk.split_with_sizes([self.num_heads, self.num_kv_heads], 1)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            return self._project(self.attn.forward(q, k, v), keep_rows)
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self._project(self.attn.forward(q, k, v), keep_rows)

    def _project(self, out: torch.Tensor, keep_rows: torch.Tensor | None) -> torch.Tensor:
        if keep_rows is not None:
            out = out.index_select(0, keep_rows)
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        ffn = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [ffn] * 2)
        self.down_proj = RowParallelLinear(ffn, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.gate_up_proj.silu_and_mul(x, self.act_fn))


# the feed-forward block of a layer: (config, layer index) -> module taking and returning
# [tokens, hidden] (MLP, or a mixture of experts: models/qwen3_moe.py)
MakeMLP = Callable[[ModelConfig, int], nn.Module]


def dense_mlp(config: ModelConfig, layer: int) -> nn.Module:
    return MLP(config)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, qk_norm: bool,
                 rotary_emb: RotaryEmbedding, make_mlp: MakeMLP = dense_mlp) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer, qk_norm, rotary_emb)
        self.mlp = make_mlp(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over every token of x, or, past the attention, only over the rows
        keep_rows indexes (the outputs are those rows', in keep_rows' order)."""
        if residual is None:
            x, residual = self.input_layernorm.forward(x), x
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(positions, x, keep_rows)
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, make_mlp: MakeMLP = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary embedding for all layers (its cos/sin lookup is then done once per step),
        # owned by this model: built on this model's device, never shared with another model.
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                     config.rope_theta, config.rope_scaling, config.rotary_dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i, qk_norm, rotary_emb, make_mlp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input."""
        return self.embed_tokens.forward(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every token, or of the rows keep_rows indexes: then the
        last layer runs its attention output, MLP and the final norm on those rows only
        (every token's k and v are still cached), as llama.cpp does for the tokens whose
        logits are not needed."""
        x, residual = self.embed(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # a call: fault injection hooks layers
            x, residual = layer(positions, x, residual, keep_rows if i == last else None)
        x, _ = self.norm.forward(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our merged parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False
    decoder_class: type[nn.Module] = DecoderModel  # built as decoder_class(config, qk_norm)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder_class(config, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # forward() takes keep_rows (see DecoderModel.forward)
    computes_kept_rows = True

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor a checkpoint of this model must hold."""
        h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
        q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.o_proj.weight": (h, q_rows),
            })
            shapes.update(cls.qkv_shapes(p + "self_attn.", config))
            shapes.update(cls.mlp_shapes(p + "mlp.", h, ffn))
            if config.attention_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if cls.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (hd,),
                               p + "self_attn.k_norm.weight": (hd,)})
        return shapes

    @staticmethod
    def qkv_shapes(prefix: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, hd = config.hidden_size, config.head_dim
        q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
        shapes = {prefix + "q_proj.weight": (q_rows, h), prefix + "k_proj.weight": (kv_rows, h),
                  prefix + "v_proj.weight": (kv_rows, h)}
        if config.attention_bias or config.qkv_bias:
            shapes.update({prefix + "q_proj.bias": (q_rows,), prefix + "k_proj.bias": (kv_rows,),
                           prefix + "v_proj.bias": (kv_rows,)})
        return shapes

    @staticmethod
    def mlp_shapes(prefix: str, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "gate_proj.weight": (ffn, hidden), prefix + "up_proj.weight": (ffn, hidden),
                prefix + "down_proj.weight": (hidden, ffn)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every input token, or of the rows keep_rows indexes."""
        return self.model(input_ids, positions, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the merged, sharded parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = self.weight_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            if isinstance(tensor, GGUFWeight):  # a GGUF weight to keep quantized
                module, _, param_name = target.rpartition(".")
                if take_gguf(self.get_submodule(module), param_name, tensor, shard):
                    loaded.add(target)
                    continue
                tensor = tensor.dequantize()
            loader = getattr(param, "weight_loader", _copy_weight)
            loader(param, tensor.to(param.dtype), *shard)
            loaded.add(target)
        missing = {n for n in params if n not in loaded
                   and not (n == "lm_head.weight" and self.config.tie_word_embeddings)}
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def weight_target(self, name: str) -> tuple[str, tuple[object, ...]]:
        """The parameter a checkpoint tensor is copied into, and the shard arguments its
        weight_loader takes (none for a parameter of its own)."""
        for ckpt, (merged, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt}." in name:
                return name.replace(ckpt, merged), (shard_id,)
        return name, ()
