"""A bf16 or fp32 decode step on the CPU as one C++ call (kernels/csrc/decode_stack.cpp), beside
cuda_graph.py's replayed decode steps: the model runner picks, per step, the model's forward,
a CUDA graph or this stack. A step whose rows are decodes and rows of a few new tokens over
a cached prefix (drafts being verified, a short chunk, a prompt after a cached prefix) is
one too: the paged-attention kernel takes up to cpu_paged.MAX_KERNEL_QUERY_LEN query tokens
a row.

The stack runs the kernels the model's per-op forward runs (on the CPU kernels: RMSNorm or
Gemma's, the linears' methods and biases, q/k norms, rotary, store_kv, paged attention with
the layer's window and soft-cap, SiLU-and-mul or torch's tanh GELU, a mixture of experts'
routing and moe_experts), in the same order on the same tensors, so its results are the
same bit for bit. It saves the Python and torch dispatch around ~12-20 ops a layer: about
1 ms a step at one row for SmolLM2's 30 layers.

Each layer is described as data (kernels/csrc/ops.h StackLayer), so the families differ in
their descriptions, not in the C++ loop. It applies to:
- Llama, Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (q/k norms), Mistral (any window);
- Gemma 2 and 3 text layers: (1 + w) norms before and after the attention and the MLP,
  GeGLU, query_pre_attn_scalar, soft-capped scores, interleaved sliding and global layers
  each with its rope base (the embedding's scaling runs before the call, the final logits'
  soft-cap after it, in compute_logits);
- Phi-3 / Phi-4-mini: partial rotary and LongRoPE (steps whose rows straddle the original
  context, some longer and some not, run op by op);
- mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): the router's
  torch softmax and top-k, then moe_experts;
on the cpu_paged backend, one tensor-parallel rank. bf16 activations (AVX512-BF16 CPUs) with
bf16 weights or GGUF ones kept quantized; fp32 activations (what `--dtype auto` gives GGUF
files and HF directories on CPUs without AVX512-BF16, e.g. AVX2-only AMD Zen 2/3 and most
laptops) with fp32 weights (torch's linear) or GGUF ones, Gemma excepted. A step with a
cascade (a prefix several rows share) runs op by op where some layer takes a window or
soft-cap in it (those take no cascade), and in fp32 (the cascade kernel is bf16).

Its per-model arguments are gathered once (~0.65 ms for SmolLM2) and checked each step by
identity (~12 us), so a forward hook put on a layer (the step then runs op by op, and the
hook fires), a cache rebound or a weight repacked since is seen. `enforce_eager=True` turns
it off.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm.attention import cpu_paged
from pagedllm.attention.context import Context
from pagedllm.kernels import ops, probes
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.linear_methods import (OneDNNLinearMethod, PackedBf16LinearMethod,
                                            TorchLinearMethod)
from pagedllm.layers.moe import FusedMoE
from pagedllm.models.gemma import GemmaDecoderLayer, GemmaMLP, GemmaModel
from pagedllm.models.llama import MLP, DecoderLayer, DecoderModel
from pagedllm.models.qwen3_moe import SparseMoeBlock

# the norms the stack runs -> whether they scale by 1 + weight (the kernels' unit_offset)
_NORM_KINDS: dict[type, bool] = {RMSNorm: False, GemmaRMSNorm: True}


def _stack_linear(m: LinearBase, dtype: torch.dtype) -> object | None:
    """The stack's description of a linear of rows in dtype (kernels/csrc/ops.h
    StackLinear), None where its method is not one the stack runs: GGUF parts kept
    quantized; for bf16, pagedllm's packed kernel or oneDNN's (with the weight-streaming and
    AMX kernels for few rows); for fp32, torch's linear."""
    bias = m.bias
    if bias is not None and bias.dtype != dtype:
        return None
    if m.gguf_parts is not None:
        return ops.stack_linear(m.weight, m.weight, [p.packed for p in m.gguf_parts],
                                [int(p.qtype) for p in m.gguf_parts],
                                [p.stop - p.start for p in m.gguf_parts], bias)
    if m.weight.dtype != dtype or not m.weight.is_contiguous():
        return None
    if dtype == torch.float32:
        if not isinstance(m.linear_method, TorchLinearMethod):
            return None
        return ops.stack_linear(m.weight, m.weight, [], [], [], bias)
    if isinstance(m.linear_method, PackedBf16LinearMethod):
        return ops.stack_linear(m.weight, m.packed_weight, [], [], [], bias)
    if isinstance(m.linear_method, OneDNNLinearMethod):
        # the weight again where there is no packing: the stack then streams the plain one
        # (decode_layers takes few rows only, see CpuDecodeStack.run)
        packed = m.weight if m.packed_weight is None else m.packed_weight
        return ops.stack_linear(m.weight, packed, [], [], [], bias)
    return None


def _attention_options(attn: Attention) -> tuple[int, float] | None:
    """(window, soft-cap) of a layer that attends through cpu_paged's kernels (0: none),
    None for another backend."""
    impl = attn.impl
    if impl is cpu_paged.attention:
        return 0, 0.0
    if isinstance(impl, functools.partial) and impl.func is cpu_paged.attention and not impl.args:
        return impl.keywords.get("window") or 0, impl.keywords.get("softcap") or 0.0
    return None


class _StackArgs:
    """The stack's per-model arguments: each layer's description (norms, linears, attention
    options, rotary caches, MLP or experts, KV caches) and the final norm; with what they
    were taken from, to check them each step by identity. all_packed: every linear computes
    from a packing that takes any row count (without one, a linear can only take the
    weight-streaming kernel: up to probes.small_linear_rows() rows)."""

    def __init__(self, model: DecoderModel | GemmaModel, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the rows': bf16, or fp32
        self.layers: list[nn.Module] = list(model.layers)
        self.eps: float = model.norm.eps
        self.stack_layers: list[object] = []
        self.linears: list[LinearBase] = []
        self.attns: list[Attention] = []
        self.experts: list[tuple[FusedMoE, tuple]] = []  # with the description gathered
        self.attention_options: list[tuple[int, float]] = []  # (window, soft-cap) per layer
        self.long_after: int | None = None  # LongRoPE's original context
        self.final_norm = model.norm.weight

    def finish(self) -> None:
        """What the layers' descriptions leave to check each step."""
        self.packed = [m.packed_weight for m in self.linears]
        self.parts = [m.gguf_parts for m in self.linears]
        self.all_packed = all(m.packed_weight is not None or m.gguf_parts is not None
                              or self.dtype == torch.float32 for m in self.linears)
        self.k_caches = [a.k_cache for a in self.attns]
        self.v_caches = [a.v_cache for a in self.attns]
        self.stack = ops.stack_layers(self.stack_layers)  # copied once, not each step

    def current(self) -> bool:
        """Nothing hooks a layer, and the caches, packed weights and experts are those
        gathered."""
        return (not any(ops.has_forward_hooks(layer) for layer in self.layers)
                and all(a.k_cache is k and a.v_cache is v
                        for a, k, v in zip(self.attns, self.k_caches, self.v_caches))
                and all(m.packed_weight is w and m.gguf_parts is p
                        for m, w, p in zip(self.linears, self.packed, self.parts))
                and all(e.kernel_experts() is d for e, d in self.experts))

    @staticmethod
    def gather(model: DecoderModel | GemmaModel, dtype: torch.dtype) -> _StackArgs | None:
        """The arguments, or None where the stack does not apply."""
        args = _StackArgs(model, dtype)
        for layer in args.layers:
            described = args._layer(layer)
            if described is None:
                return None
            args.stack_layers.append(described)
        final = model.norm
        if (_NORM_KINDS.get(type(final)) != _NORM_KINDS[type(args.layers[0].input_layernorm)]
                or final.weight.dtype != dtype):
            return None
        args.finish()
        return args

    def _layer(self, layer: nn.Module) -> object | None:
        """A decoder layer's description (ops.h StackLayer), its linears, attention and
        experts noted; None where the stack does not run it."""
        if type(layer) not in (DecoderLayer, GemmaDecoderLayer) or ops.has_forward_hooks(layer):
            return None
        block = layer.self_attn
        attn, options = block.attn, _attention_options(block.attn)
        if options is None or block.qkv_proj.tp_size != 1 or not attn.k_cache.numel():
            return None
        norms = self._norms(layer)
        qkv, o = _stack_linear(block.qkv_proj, self.dtype), _stack_linear(block.o_proj, self.dtype)
        feed_forward = self._feed_forward(layer.mlp)
        if norms is None or qkv is None or o is None or feed_forward is None:
            return None
        self.linears += [block.qkv_proj, block.o_proj]
        self.attns.append(attn)
        self.attention_options.append(options)
        rotary = block.rotary_emb
        rope = dict(rotary_dim=rotary.rotary_dim, cos=rotary.cos_cache, sin=rotary.sin_cache)
        if rotary.long_after is not None:
            self.long_after = rotary.long_after
            rope.update(long_after=rotary.long_after, long_cos=rotary.long_cos_cache,
                        long_sin=rotary.long_sin_cache)
        window, softcap = options
        return ops.stack_layer(**norms, qkv=qkv, o=o, scale=attn.scale, window=window,
                               softcap=softcap, **rope, **feed_forward,
                               k_cache=attn.k_cache, v_cache=attn.v_cache)

    def _norms(self, layer: nn.Module) -> dict[str, object] | None:
        """The layer's norm weights by their StackLayer names and unit_offset_norms; None
        unless they are all of one kind the stack runs, in the rows' dtype, with the model's
        eps."""
        block = layer.self_attn
        norms = {"input_norm": layer.input_layernorm,
                 "post_attn_norm": layer.post_attention_layernorm}
        if type(layer) is GemmaDecoderLayer:
            norms.update(pre_mlp_norm=layer.pre_feedforward_layernorm,
                         post_mlp_norm=layer.post_feedforward_layernorm)
        if block.q_norm is not None:
            norms.update(q_norm=block.q_norm, k_norm=block.k_norm)
        kinds = {_NORM_KINDS.get(type(n)) for n in norms.values()}
        if (len(kinds) != 1 or None in kinds
                or any(n.weight.dtype != self.dtype or n.eps != self.eps
                       for n in norms.values())):
            return None
        return {**{name: n.weight for name, n in norms.items()}, "unit_offset_norms": kinds.pop()}

    def _feed_forward(self, mlp: nn.Module) -> dict[str, object] | None:
        """{"mlp": a dense MLP's description} or {"moe": a mixture of experts'}; None where
        the stack does not run the block."""
        if type(mlp) in (MLP, GemmaMLP):
            gate_up = _stack_linear(mlp.gate_up_proj, self.dtype)
            down = _stack_linear(mlp.down_proj, self.dtype)
            if gate_up is None or down is None:
                return None
            self.linears += [mlp.gate_up_proj, mlp.down_proj]
            return {"mlp": ops.stack_mlp(gate_up, down, gelu=type(mlp) is GemmaMLP)}
        if type(mlp) is not SparseMoeBlock:
            return None
        experts = mlp.experts
        described = experts.kernel_experts()
        router = _stack_linear(mlp.gate, self.dtype)
        if (described is None or router is None or experts.tp_size != 1
                or experts.forward != experts.forward_grouped):
            return None
        fields = dict(router=router, gate_up=described[0], down=described[1],
                      top_k=experts.top_k, renormalize=experts.renormalize,
                      weights_in_fp32=experts.weights_in_fp32)
        if mlp.shared_expert is not None:
            shared = self._feed_forward(mlp.shared_expert)
            gate = _stack_linear(mlp.shared_expert_gate, self.dtype)
            if shared is None or gate is None:
                return None
            self.linears.append(mlp.shared_expert_gate)
            fields.update(shared=shared["mlp"], shared_gate=gate)
        self.linears.append(mlp.gate)
        self.experts.append((experts, described))
        return {"moe": ops.stack_moe(**fields)}


class CpuDecodeStack:
    """The one-call decode executor of a decoder model (models/llama.py's or gemma.py's)."""

    def __init__(self, model: DecoderModel | GemmaModel, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.args: _StackArgs | None = None  # gathered at the first step it runs

    @staticmethod
    def runs_here(dtype: torch.dtype) -> bool:
        """Whether this CPU and build run the stack for activations of dtype: bf16 where the
        AVX512-BF16 linears run; fp32 where the elementwise kernels are vector code (AVX-512
        or AVX2: laptops and AMD Zen 2/3 too), its linears torch's or GGUF ones."""
        if dtype == torch.bfloat16:
            return probes.has_avx512_bf16()
        return dtype == torch.float32 and probes.elementwise_vectorized()

    @staticmethod
    def for_model(model: nn.Module, dtype: torch.dtype) -> CpuDecodeStack | None:
        """The executor for a CPU model, or None where it can never apply: not runs_here,
        not one of the decoders it describes; in fp32, Gemma (its norms keep torch's ops in
        fp32, HF's own) or a mixture of experts whose experts are not GGUF ones (moe_experts
        takes fp32 rows over those only)."""
        decoder = getattr(model, "model", None)
        if not CpuDecodeStack.runs_here(dtype) \
                or not isinstance(decoder, (DecoderModel, GemmaModel)):
            return None
        if dtype == torch.float32 and (
                isinstance(decoder, GemmaModel)
                or any(isinstance(m, FusedMoE) and m.gguf_experts is None
                       for m in decoder.modules())):
            return None
        return CpuDecodeStack(decoder, dtype)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context
            ) -> torch.Tensor | None:
        """The final hidden states of a decode step, or of a step whose other rows add at
        most cpu_paged.MAX_KERNEL_QUERY_LEN tokens each to a cached prefix (drafts being
        verified, short chunks); None where the stack does not apply to this step (the
        runner then runs the model's forward)."""
        if ctx.block_tables is None:
            return None
        args = self.args
        if args is None or not args.current():
            args = _StackArgs.gather(self.model, self.dtype)
            if args is None:  # (the last arguments gathered stay, to be checked next step)
                return None
            self.args = args
        rows = input_ids.shape[0]
        if not args.all_packed and rows > probes.small_linear_rows():
            return None
        longest = cpu_paged.longest_context(ctx)
        if args.long_after is not None:  # LongRoPE: every row's rotation from one table
            lengths = ctx.seqlens_k if ctx.seqlens_k is not None else ctx.context_lens.tolist()
            if len({length > args.long_after for length in lengths}) > 1:
                return None
        # layers that take a window or soft-cap in this step take no cascade (cpu_paged)
        uncascaded = [bool(window and longest > window) or softcap > 0
                      for window, softcap in args.attention_options]
        first = self.model.layers[0].self_attn
        block_size = args.k_caches[0].shape[1]
        if ctx.is_prefill:  # drafts being verified, short chunks: every row on the kernel
            plan = cpu_paged.short_rows_plan(ctx, block_size, cascade=not all(uncascaded))
            if plan is None:
                return None
        else:
            plan = cpu_paged.decode_plan(ctx, rows, block_size, cascade=not all(uncascaded))
        prefix_blocks, prefix_first = None, -1
        if plan.prefixes:  # cascade: one prefix shared by every row, on the attention kernel
            if (any(uncascaded) or len(plan.prefixes) != 1 or plan.prefixes[0].tokens is not None
                    or not cpu_paged.attention_kernel(self.dtype, first.head_dim)):
                return None
            prefix = plan.prefixes[0]
            prefix_blocks = prefix.blocks
            if isinstance(prefix.cache_index, slice):  # adjacent blocks: a view of the cache
                prefix_first = prefix.cache_index.start
        return ops.decode_layers(self.model.embed(input_ids), positions, args.stack,
                                 args.final_norm, ctx.slot_mapping, plan.tables, plan.q_starts,
                                 plan.q_lens, plan.k_lens, longest, first.num_heads,
                                 first.num_kv_heads, args.eps, probes.small_linear_rows(),
                                 probes.amx_linear_rows(), prefix_blocks, prefix_first)
