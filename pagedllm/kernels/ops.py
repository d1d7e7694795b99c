"""Typed wrappers, one per op, over pagedllm's C++ CPU kernels (kernels/csrc) and over the
private torch ops pagedllm relies on (oneDNN's prepacked linear, CPU flash attention with
its log-sum-exp, module hook tables). Everything outside kernels/ calls these, so this file
and build.py are the only places that know how a kernel is reached.

Call a C++ op only where kernels.probes says it runs (an op called without the extension
raises a RuntimeError naming why the build failed).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from pagedllm.kernels import build

Tensor = torch.Tensor


class _NotLoaded:
    """Stands for the extension until its first use, then replaces itself with it."""

    def __getattr__(self, name: str) -> object:
        global _ext
        ext = build.load()
        if ext is None:
            raise RuntimeError(f"the C++ CPU kernels are not available ({build.load_error})")
        _ext = ext
        return getattr(ext, name)


_ext: ModuleType | _NotLoaded = _NotLoaded()


# ---- attention (paged_attention.cpp, prompt_attention.cpp) ------------------------------------

def paged_attention(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                    block_tables: Tensor, q_starts: Tensor, q_lens: Tensor, k_lens: Tensor,
                    scale: float, prefix_out: Tensor | None = None,
                    prefix_lse: Tensor | None = None, window: int = 0,
                    softcap: float = 0.0) -> None:
    """out[rows' new tokens] = causal attention over the paged K/V, read in place; merged by
    log-sum-exp with a shared prefix's attention when prefix_out / prefix_lse are given.
    window > 0: each query sees its last `window` positions only (table entries of blocks
    wholly before its row's first query's window are never read); softcap > 0: scores
    soft-capped (cap * tanh(s / cap))."""
    _ext.paged_attention(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, k_lens, scale,
                         prefix_out, prefix_lse, window, softcap)


def prompt_attention(out: Tensor, q: Tensor, k: Tensor, v: Tensor, starts: Tensor,
                     lens: Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """out[prompts' tokens] = causal attention of each prompt over its own tokens (bf16);
    window / softcap as paged_attention's (0: none)."""
    _ext.prompt_attention(out, q, k, v, starts, lens, scale, window, softcap)


def attention_over_keys(out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                        causal: bool, window: int = 0, softcap: float = 0.0) -> Tensor:
    """out = attention of q [T, H, D] over k/v [S, Hkv, D] (causal: q are the last T of the
    S positions; else every query sees every key); returns the log-sum-exp [T, H]. window
    (causal only) / softcap as paged_attention's."""
    return _ext.attention_over_keys(out, q, k, v, scale, causal, window, softcap)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """Each new token's K and V into its cache slot (-1: skipped)."""
    _ext.store_kv(k, v, k_cache, v_cache, slot_mapping)


def allow_dot_scores(allowed: bool) -> None:
    """Tests: True makes paged_attention score bf16 keys by AVX512-BF16 dot products where
    the CPU has them (the default but on AMX CPUs, which widen them), False widens them."""
    _ext.allow_dot_scores(allowed)


def allow_amx_attention(allowed: bool) -> None:
    """Tests: False makes the attention kernels use AVX512-BF16 even where AMX runs."""
    _ext.allow_amx_attention(allowed)


# ---- linears (small_linear.cpp, amx_linear.cpp, packed_linear.cpp, gguf_linear.cpp) -----------

def small_linear_bf16(x: Tensor, w: Tensor) -> Tensor:
    """x w^T for a few bf16 rows, streaming the plain bf16 weight once."""
    return _ext.small_linear_bf16(x, w)


def amx_linear_bf16(x: Tensor, w: Tensor) -> Tensor:
    """x w^T for 1-32 bf16 rows on AMX tiles, from the plain weight (K, N multiples of 32)."""
    return _ext.amx_linear_bf16(x, w)


def pack_linear_weight_bf16(w: Tensor) -> Tensor:
    """The bf16 weight [N, K] packed for packed_linear_bf16: [N/16, K/2, 16, 2]."""
    return _ext.pack_linear_weight_bf16(w)


def packed_linear_uses_amx(k: int) -> bool:
    """Whether packed_linear_bf16 runs on AMX tiles here for inputs of k features."""
    return _ext.packed_linear_uses_amx(k)


def allow_amx_linear(allowed: bool) -> None:
    """Tests: False makes packed_linear_bf16 take AVX512-BF16 dot products where AMX runs."""
    _ext.allow_amx_linear(allowed)


def packed_linear_bf16(x: Tensor, packed: Tensor, fp32_out: bool = False) -> Tensor:
    """x w^T for any number of bf16 rows from the packed weight; fp32_out: the fp32 sums."""
    return _ext.packed_linear_bf16(x, packed, fp32_out)


def packed_gate_up_silu_bf16(x: Tensor, packed: Tensor) -> Tensor:
    """silu(gate) * up of a packed [gate; up] projection in one pass (the results of
    packed_linear_bf16 then silu_and_mul, bit for bit)."""
    return _ext.packed_gate_up_silu_bf16(x, packed)


def gguf_linear(x: Tensor, packed: Tensor, qtype: int, n: int, out: Tensor | None = None,
                fp32_out: bool = False) -> Tensor:
    """x w^T for bf16 rows from a GGUF weight [n, K] of ggml type qtype packed by
    layers/gguf_packing.py pack_gguf (its exact values); writes the first n columns of out
    (bf16, or fp32 with fp32_out) if given, and returns them."""
    return _ext.gguf_linear(x, packed, qtype, n, out, fp32_out)


def gguf_pack(raw: Tensor, qtype: int, n: int, k: int) -> Tensor:
    """A GGUF weight's blocks (uint8 [n, bytes per row], as the file holds them) in
    gguf_linear's layout, flat uint8."""
    return _ext.gguf_pack(raw, qtype, n, k)


def gguf_packed_nbytes(qtype: int, n: int, k: int) -> int:
    """Bytes of pack_gguf's layout for a weight [n, k] of ggml type qtype."""
    return _ext.gguf_packed_nbytes(qtype, n, k)


def gguf_dequantize_rows(packed: Tensor, qtype: int, n: int, k: int, rows: Tensor) -> Tensor:
    """The exact float32 weights of some output rows [len(rows), k], from the packed form."""
    return _ext.gguf_dequantize_rows(packed, qtype, n, k, rows)


def gguf_linear_isa() -> str:
    """What gguf_linear runs on: 'amx', 'avx512_bf16', 'avx2' or '' (neither built)."""
    return _ext.gguf_linear_isa()


def force_gguf_linear_isa(isa: str) -> None:
    """Tests: 'amx', 'avx512_bf16' or 'avx2' make gguf_linear take that path from now on
    (an error where the build or CPU lacks it); '': the best one (AMX where it runs)."""
    _ext.force_gguf_linear_isa(isa)


# ---- elementwise (elementwise.cpp) ------------------------------------------------------------

def rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
             unit_offset: bool = False) -> list[Tensor]:
    """[norm(x)], or with a residual [norm(x + residual), x + residual]; unit_offset:
    Gemma's norm, scaling by 1 + weight in fp32 (rounded once)."""
    return _ext.rms_norm(x, residual, weight, eps, unit_offset)


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(x[:, :I]) * x[:, I:]."""
    return _ext.silu_and_mul(x)


def rotary_embedding(positions: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate x [T, heads, D] in place by its positions (half-rotation layout)."""
    _ext.rotary_embedding(positions, x, cos, sin)


def argmax_rows(x: Tensor) -> Tensor:
    """Each row's first largest index (torch.argmax's answer)."""
    return _ext.argmax_rows(x)


def apply_token_bitmask_(logits: Tensor, masks: Tensor, rows: Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t % 32 of word t // 32 of masks[i]
    (int32 [M, ceil(V / 32)]) is 0."""
    _ext.apply_token_bitmask_(logits, masks, rows)


# ---- the one-call decode stack (decode_stack.cpp) -----------------------------------------------

def stack_linear(weight: Tensor, packed: Tensor, parts: list[Tensor], part_types: list[int],
                 part_rows: list[int], bias: Tensor | None) -> object:
    """A linear layer's description for decode_layers (ops.h StackLinear)."""
    return _ext.StackLinear(weight, packed, parts, part_types, part_rows, bias)


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: list[object],
                down: list[object], small_rows: int) -> Tensor:
    """The routed experts of a MoE block for bf16 rows x, each chosen expert run once over
    its tokens (ops.h moe_experts; experts described by stack_linear)."""
    return _ext.moe_experts(x, ids, weights, gate_up, down, small_rows)


def _filled(description: object, fields: dict[str, object]) -> object:
    for name, value in fields.items():  # an unknown name raises AttributeError
        setattr(description, name, value)
    return description


def stack_mlp(gate_up: object, down: object, gelu: bool) -> object:
    """A dense MLP's description for decode_layers (ops.h StackMLP); gelu: Gemma's GeGLU
    (tanh GELU), else SiLU."""
    activation = _ext.StackActivation.gelu_tanh if gelu else _ext.StackActivation.silu
    return _filled(_ext.StackMLP(), dict(gate_up=gate_up, down=down, activation=activation))


def stack_moe(**fields: object) -> object:
    """A mixture-of-experts block's description for decode_layers (ops.h StackMoE: router,
    gate_up, down, top_k, renormalize, weights_in_fp32, shared, shared_gate)."""
    return _filled(_ext.StackMoE(), fields)


def stack_layer(**fields: object) -> object:
    """A decoder layer's description for decode_layers (ops.h StackLayer, field by field)."""
    return _filled(_ext.StackLayer(), fields)


def stack_layers(layers: list[object]) -> object:
    """The layers' descriptions as decode_layers takes them, copied once (ops.h StackLayers):
    a list is copied, every expert's description with it, on every call."""
    return _ext.StackLayers(layers)


def decode_layers(x: Tensor, positions: Tensor, layers: object, final_norm: Tensor,
                  slot_mapping: Tensor, block_tables: Tensor, q_starts: Tensor,
                  q_lens: Tensor, k_lens: Tensor, longest_context: int, num_heads: int,
                  num_kv_heads: int, eps: float, small_rows: int, amx_rows: int,
                  prefix_blocks: Tensor | None, prefix_first: int) -> Tensor:
    """A bf16 decode step's decoder layers and final norm in one call (see ops.h); layers:
    stack_layers' result."""
    return _ext.decode_layers(x, positions, layers, final_norm, slot_mapping, block_tables,
                              q_starts, q_lens, k_lens, longest_context, num_heads,
                              num_kv_heads, eps, small_rows, amx_rows, prefix_blocks,
                              prefix_first)


# ---- private torch ops -------------------------------------------------------------------------

def onednn_pack_linear_weight(weight: Tensor) -> Tensor | None:
    """The bf16 weight in oneDNN's blocked layout (an opaque tensor), None where torch's
    oneDNN cannot pack bf16 on this CPU. The batch-size hint (64) only picks a blocking;
    results equal F.linear's."""
    if not onednn_packs_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether torch's oneDNN packs bf16 linear weights here: it needs AVX512BW/VL/DQ or
    AVX-NE-CONVERT, and refuses (a RuntimeError) on AVX2-only CPUs such as AMD Zen 2/3,
    where bf16 linears fall back to F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 64)
    except RuntimeError:
        return False
    return True


def onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x w^T (+ bias) on oneDNN's prepacked weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def onednn_data_ptr(packed: Tensor) -> int:
    """Where an opaque oneDNN tensor's data lies (to put it on huge pages)."""
    return torch.ops.mkldnn.data_ptr(packed)


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float
                             ) -> tuple[Tensor, Tensor]:
    """torch's CPU flash attention without a mask on [B, H, T, D] tensors: the output and
    each query's log-sum-exp [B, H, T] (SDPA's public API drops the latter)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                           scale=scale)
    return out, lse


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether a forward (pre-)hook sits on the module, or on every module (global hooks):
    an executor that runs the module's work in C++ would skip it."""
    return bool(module._forward_pre_hooks or module._forward_hooks
                or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)
