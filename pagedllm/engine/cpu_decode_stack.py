"""A bf16 decode step on the CPU as one C++ call (kernels/csrc/decode_stack.cpp), beside
cuda_graph.py's replayed decode steps: the model runner picks, per step, the model's forward,
a CUDA graph or this stack.

The stack runs the kernels the model's per-op forward runs (models/llama.py on the CPU
kernels: RMSNorm, the linears' methods and biases, q/k norms, rotary, store_kv, paged
attention, SiLU-and-mul), in the same order on the same tensors, so its results are the
same bit for bit. It saves the Python and torch dispatch around ~12-16 ops a layer: about
1 ms a step at one row for SmolLM2's 30 layers.

It applies to Llama-structured layers (Llama, Qwen2 with its q/k/v biases, Qwen3 with its
q/k norms, Mistral where the window is longer than the model; a dense MLP; no windows,
soft-caps, partial or LongRoPE rotary, or tensor parallelism) on the cpu_paged backend,
with bf16 weights or GGUF ones kept quantized. Its per-model arguments are gathered once (~0.65 ms) and checked each step
by identity (~12 us), so a forward hook put on a layer (the step then runs op by op, and the
hook fires), a cache rebound or a weight repacked since is seen. `enforce_eager=True` turns
it off.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import cpu_paged
from pagedllm.attention.context import Context
from pagedllm.kernels import ops, probes
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.linear_methods import OneDNNLinearMethod, PackedBf16LinearMethod
from pagedllm.models.llama import MLP, DecoderLayer, DecoderModel


def _stack_linear(m: LinearBase) -> object | None:
    """The stack's description of a linear (kernels/csrc/ops.h StackLinear), None where its
    method is not one the stack runs: pagedllm's packed bf16 kernel, oneDNN's (with the
    weight-streaming and AMX kernels for few rows), or GGUF parts kept quantized."""
    bias = m.bias
    if m.gguf_parts is not None:
        if bias is not None and bias.dtype != torch.bfloat16:
            return None
        return ops.stack_linear(m.weight, m.weight, [p.packed for p in m.gguf_parts],
                                [int(p.qtype) for p in m.gguf_parts],
                                [p.stop - p.start for p in m.gguf_parts], bias)
    if m.weight.dtype != torch.bfloat16 or not m.weight.is_contiguous():
        return None
    if isinstance(m.linear_method, PackedBf16LinearMethod):
        return ops.stack_linear(m.weight, m.packed_weight, [], [], [], bias)
    if isinstance(m.linear_method, OneDNNLinearMethod):
        # the weight again where there is no packing: the stack then streams the plain one
        # (decode_layers takes few rows only, see CpuDecodeStack.run)
        packed = m.weight if m.packed_weight is None else m.packed_weight
        return ops.stack_linear(m.weight, packed, [], [], [], bias)
    return None


class _StackArgs:
    """The stack's per-model arguments: each layer's norms, linears and KV caches, the final
    norm; with what they were taken from, to check them each step by identity. all_packed:
    every linear computes from a packing that takes any row count (without one, a linear can
    only take the weight-streaming kernel: up to probes.small_linear_rows() rows)."""

    def __init__(self, layers: list[DecoderLayer], linears: list[LinearBase],
                 stack_layers: list[object], attns: list[Attention], final_norm: torch.Tensor
                 ) -> None:
        self.layers, self.linears, self.stack_layers, self.attns = layers, linears, stack_layers, attns
        self.final_norm = final_norm
        self.packed = [m.packed_weight for m in linears]
        self.parts = [m.gguf_parts for m in linears]
        self.all_packed = all(m.packed_weight is not None or m.gguf_parts is not None
                              for m in linears)
        self.k_caches = [a.k_cache for a in attns]
        self.v_caches = [a.v_cache for a in attns]

    def current(self) -> bool:
        """Nothing hooks a layer, and the caches and packed weights are those gathered."""
        return (not any(ops.has_forward_hooks(layer) for layer in self.layers)
                and all(a.k_cache is k and a.v_cache is v
                        for a, k, v in zip(self.attns, self.k_caches, self.v_caches))
                and all(m.packed_weight is w and m.gguf_parts is p
                        for m, w, p in zip(self.linears, self.packed, self.parts)))

    @staticmethod
    def gather(model: DecoderModel) -> _StackArgs | None:
        """The arguments, or None where the stack does not apply."""
        layers, linears, stack_layers, attns = list(model.layers), [], [], []
        for layer in layers:
            if (type(layer) is not DecoderLayer or type(layer.mlp) is not MLP
                    or ops.has_forward_hooks(layer)):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if (not attn.rotary_emb.plain or attn.qkv_proj.tp_size != 1
                    or attn.attn.impl is not cpu_paged.attention or not attn.attn.k_cache.numel()):
                return None
            layer_linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            described = [_stack_linear(m) for m in layer_linears]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.q_norm is not None:
                norms += [attn.q_norm.weight, attn.k_norm.weight]
            if any(d is None for d in described) or any(
                    type(n) is not RMSNorm for n in (layer.input_layernorm,
                                                     layer.post_attention_layernorm)) or any(
                    w.dtype != torch.bfloat16 for w in norms):
                return None
            q_norm = None if attn.q_norm is None else attn.q_norm.weight
            k_norm = None if attn.k_norm is None else attn.k_norm.weight
            stack_layers.append(ops.stack_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q_norm,
                k_norm, *described, attn.attn.k_cache, attn.attn.v_cache))
            linears += layer_linears
            attns.append(attn.attn)
        if type(model.norm) is not RMSNorm or model.norm.weight.dtype != torch.bfloat16:
            return None
        return _StackArgs(layers, linears, stack_layers, attns, model.norm.weight)


class CpuDecodeStack:
    """The one-call decode executor of a Llama-structured model."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.args: _StackArgs | None = None  # gathered at the first step it runs

    @staticmethod
    def for_model(model: nn.Module, dtype: torch.dtype) -> CpuDecodeStack | None:
        """The executor for a CPU model, or None where it can never apply: not bf16, no
        AVX512-BF16 kernels, or not a Llama-structured decoder."""
        decoder = getattr(model, "model", None)
        if dtype != torch.bfloat16 or not probes.has_avx512_bf16() \
                or not isinstance(decoder, DecoderModel):
            return None
        return CpuDecodeStack(decoder)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context
            ) -> torch.Tensor | None:
        """The final hidden states of a decode step, or None where the stack does not apply
        to this step (the runner then runs the model's forward)."""
        if ctx.is_prefill or ctx.block_tables is None:
            return None
        args = self.args
        if args is None or not args.current():
            args = _StackArgs.gather(self.model)
            if args is None:  # (the last arguments gathered stay, to be checked next step)
                return None
            self.args = args
        rows = input_ids.shape[0]
        if not args.all_packed and rows > probes.small_linear_rows():
            return None
        first = self.model.layers[0].self_attn
        plan = cpu_paged.decode_plan(ctx, rows, args.k_caches[0].shape[1])
        prefix_blocks, prefix_first = None, -1
        if plan.prefixes:  # cascade: one prefix shared by every row, on the attention kernel
            if (len(plan.prefixes) != 1 or plan.prefixes[0].tokens is not None
                    or not cpu_paged.attention_kernel(torch.bfloat16, first.head_dim)):
                return None
            prefix = plan.prefixes[0]
            prefix_blocks = prefix.blocks
            if isinstance(prefix.cache_index, slice):  # adjacent blocks: a view of the cache
                prefix_first = prefix.cache_index.start
        x = self.model.embed_tokens.forward(input_ids)
        rotary = first.rotary_emb
        return ops.decode_layers(x, positions, args.stack_layers, args.final_norm,
                                 rotary.cos_cache, rotary.sin_cache, ctx.slot_mapping,
                                 plan.tables, plan.q_starts, plan.q_lens, plan.k_lens,
                                 first.num_heads, first.num_kv_heads, self.model.norm.eps,
                                 first.attn.scale, probes.small_linear_rows(),
                                 probes.amx_linear_rows(), prefix_blocks, prefix_first)
