"""Llama-family decoder (Llama 2/3, SmolLM2) and, with q/k norms, Qwen3.

Inside a layer, submodules are run through .forward(): nn.Module.__call__'s hook handling
costs about 1 ms of a 16 ms single-stream decode step (12 calls x 30 layers, measured), and
no hooks are set on them. Layers themselves are called normally (fault injection hooks one).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedllm import cpu_ops
from pagedllm.attention import cpu_paged
from pagedllm.attention.context import get_context
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (LinearBase,
                                    MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear, amx_linear_rows, gate_up_silu, is_q4_1,
                                    small_linear_rows)
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.config import ModelConfig


def _copy_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hd = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.head_dim = hd
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=config.attention_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, hd, hd ** -0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None

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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gate_up_silu(x, self.gate_up_proj)
        if h is None:
            h = self.act_fn.forward(self.gate_up_proj.forward(x))
        return self.down_proj.forward(h)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, qk_norm, rotary_emb)
        self.mlp = MLP(config)
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


def _hooked(layer: nn.Module) -> bool:
    """Whether a forward (pre-)hook sits on the layer: the one-call stack would skip it."""
    return bool(layer._forward_pre_hooks or layer._forward_hooks)


class _FusedStack:
    """The one-call decode stack's per-model arguments: each layer's norms and linear weights
    (plain and packed), the final norm, the KV caches; with what they were taken from, to
    check them each step by identity. all_packed: every linear has a packed copy (without
    one, a linear can only take the weight-streaming kernel: up to small_linear_rows())."""

    def __init__(self, layers: list[DecoderLayer], linears: list[LinearBase],
                 weights: list[torch.Tensor], attns: list[Attention]) -> None:
        self.layers, self.linears, self.weights, self.attns = layers, linears, weights, attns
        self.packed = [m.packed_weight for m in linears]
        self.all_packed = all(w is not None for w in self.packed)
        self.k_caches = [a.k_cache for a in attns]
        self.v_caches = [a.v_cache for a in attns]

    def current(self) -> bool:
        """Nothing hooks a layer, and the caches and packed weights are those gathered."""
        return (not any(_hooked(layer) for layer in self.layers)
                and all(a.k_cache is k and a.v_cache is v
                        for a, k, v in zip(self.attns, self.k_caches, self.v_caches))
                and all(m.packed_weight is w for m, w in zip(self.linears, self.packed)))

    @staticmethod
    def gather(model: DecoderModel) -> _FusedStack | None:
        """The arguments, or None where the one-call stack does not apply."""
        layers, linears, weights, attns = list(model.layers), [], [], []
        for layer in layers:
            if type(layer) is not DecoderLayer or _hooked(layer):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if (attn.q_norm is not None or attn.qkv_proj.bias is not None
                    or attn.o_proj.bias is not None or attn.qkv_proj.tp_size != 1
                    or attn.attn.impl is not cpu_paged.attention or not attn.attn.k_cache.numel()):
                return None
            layer_linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(not m.weight.is_contiguous() for m in layer_linears):
                return None
            # each linear's weight and its packed copy, or the weight again where there is
            # none (decode_layers takes the plain one for few rows unless the copy is
            # pagedllm's: see layers/linear.py)
            qkv, o, gate_up, down = ((m.weight, m.weight if m.packed_weight is None
                                      else m.packed_weight) for m in layer_linears)
            weights += [layer.input_layernorm.weight, *qkv, *o,
                        layer.post_attention_layernorm.weight, *gate_up, *down]
            linears += layer_linears
            attns.append(attn.attn)
        weights.append(model.norm.weight)
        # (a GGUF Q4_1 weight kept quantized is packed as uint8: decode_layers takes it too)
        if not all(w.dtype == torch.bfloat16 or is_q4_1(w) for w in weights):
            return None
        return _FusedStack(layers, linears, weights, attns)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary embedding for all layers (its cos/sin lookup is then done once per step),
        # owned by this model: built on this model's device, never shared with another model.
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                     config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm, rotary_emb)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._fused_stack: _FusedStack | None = None  # the one-call decode stack's arguments

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every token, or of the rows keep_rows indexes: then the
        last layer runs its attention output, MLP and the final norm on those rows only
        (every token's k and v are still cached), as llama.cpp does for the tokens whose
        logits are not needed."""
        x, residual = self.embed_tokens.forward(input_ids), None
        if x.is_cpu and x.dtype == torch.bfloat16 and keep_rows is None:
            fused = self._fused_decode(x, positions)
            if fused is not None:
                return fused
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # a call: fault injection hooks layers
            x, residual = layer(positions, x, residual, keep_rows if i == last else None)
        x, _ = self.norm.forward(x, residual)
        return x

    def _fused_decode(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A bf16 decode step on CPU as one C++ call (csrc/decode_stack.cpp, the same kernels
        in the same order as the loop in forward, so the same results), when every layer is
        a plain Llama layer (no q/k norms, biases or tensor parallelism) on the CPU
        paged-attention backend, nothing hooks a layer, the weights are prepacked where
        more than small_linear_rows() rows need them, and a cascade step (if
        any) has one prefix shared by all rows and pagedllm's attention kernel; otherwise None.
        Its per-model arguments are gathered once (_FusedStack, ~0.65 ms) and checked each
        step by identity (~12 us), so a hook added, a cache bound or a weight repacked since
        is seen."""
        ctx = get_context()
        ext = cpu_ops.load()
        if (ctx.is_prefill or ctx.block_tables is None or ext is None
                or not ext.has_small_linear_bf16() or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks):
            return None
        stack = self._fused_stack
        if stack is None or not stack.current():
            stack = _FusedStack.gather(self)
            if stack is None:  # (the last stack gathered stays, to be checked next step)
                return None
            self._fused_stack = stack
        if not stack.all_packed and x.shape[0] > small_linear_rows():
            return None
        weights, k_caches, v_caches = stack.weights, stack.k_caches, stack.v_caches
        first = self.layers[0].self_attn
        plan = cpu_paged.decode_plan(ctx, x.shape[0], k_caches[0].shape[1])
        prefix_blocks, prefix_first = None, -1
        if plan.prefixes:  # cascade: one prefix shared by every row, on the attention kernel
            if (len(plan.prefixes) != 1 or plan.prefixes[0].tokens is not None
                    or not cpu_paged.attention_kernel(torch.bfloat16, first.head_dim)):
                return None
            prefix = plan.prefixes[0]
            prefix_blocks = prefix.blocks
            if isinstance(prefix.cache_index, slice):  # adjacent blocks: a view of the cache
                prefix_first = prefix.cache_index.start
        rotary = first.rotary_emb
        return ext.decode_layers(x, positions, weights, k_caches, v_caches, rotary.cos_cache,
                                 rotary.sin_cache, ctx.slot_mapping, plan.tables, plan.q_starts,
                                 plan.q_lens, plan.k_lens, first.num_heads, first.num_kv_heads,
                                 self.norm.eps, first.attn.scale, small_linear_rows(),
                                 amx_linear_rows(), prefix_blocks, prefix_first)


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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # forward() takes keep_rows (see DecoderModel.forward)
    computes_kept_rows = True

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
            target, shard = name, ()
            for ckpt, (merged, shard_id) in self.packed_modules_mapping.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(ckpt, merged), (shard_id,)
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", _copy_weight)
            loader(param, tensor.to(param.dtype), *shard)
            loaded.add(target)
        missing = {n for n in params if n not in loaded
                   and not (n == "lm_head.weight" and self.config.tie_word_embeddings)}
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
