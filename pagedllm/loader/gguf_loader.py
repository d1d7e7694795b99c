"""Loading a model from a GGUF file (llama.cpp's format).

GGUF stores hyper-parameters as ``{arch}.*`` metadata keys, the tokenizer as
``tokenizer.*`` keys, and weights under llama.cpp names (``blk.N.attn_q.weight``), possibly
quantized. This module maps all of it to HF conventions: a :class:`ModelConfig`, a
:class:`Tokenizer`, and weights with HF names in HF layout.

The layout differences: llama.cpp's converter permutes the rows of the Q and K
projections of "llama" models so that each head's rotary pairs are interleaved
(x0, x1), (x2, x3)... as ggml's rope expects, while HF pairs the first half of a head with
its second half (rotate-half). We undo that permutation, as HF transformers' GGUF loader
does. Qwen3 GGUFs are converted without it. Gemma 2/3 GGUFs store each norm weight w as
1 + w (Gemma's RMSNorm scales by 1 + w, ggml's by the weight): we subtract the 1 again.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.models.config import ModelConfig, pattern_layer_types
from pagedllm.models.registry import GGUF_ARCHITECTURES, SLIDING_WINDOW_PATTERNS

from .dequant import dequantize, quantized_rows
from .errors import ModelLoadError, naming_errors
from .gguf_file import GGUFFile, read_gguf
from .gguf_tokenizer import tokenizer_from_gguf
from pagedllm.layers.quantized import GGUFWeight
from .source import ModelSource
from .validate import check_weight_shapes

SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)

# llama.cpp per-layer tensor name -> HF per-layer module path
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3 keeps q, k and v fused
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, every expert's projection stacked [E, rows, cols]
    # (split per expert: {e} is the expert's index), the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")
# per-architecture differences from _LAYER_TENSORS
_GEMMA_LAYER_TENSORS = {  # four norms a layer: ffn_norm is the one before the MLP
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_TENSORS = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, as in Phi-3's checkpoints
    "gemma2": _GEMMA_LAYER_TENSORS,
    "gemma3": _GEMMA_LAYER_TENSORS,
    # a "llama" with experts is Mixtral: its checkpoints' names
    "llama": {"ffn_gate_inp": "block_sparse_moe.gate",
              "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
              "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
              "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
}
_PER_EXPERT = "{e}"
# architectures whose converter stores every norm weight w as 1 + w (Gemma's RMSNorm scales
# by 1 + w; llama.cpp's scales by its stored weight)
_NORM_PLUS_ONE_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
# tensors a GGUF may carry that have no HF weight: consumed while building the config
_CONFIG_ONLY_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                                  "rope_factors_short.weight"})


# ============================================================================ public API

def load_gguf(path: str) -> ModelSource:
    """Open a GGUF model file: parse its metadata and tokenizer; weights are read lazily.

    Raises:
        ModelLoadError: missing file, not a GGUF / truncated / corrupt, unsupported
            architecture, missing required metadata, or tensors we cannot map.
    """
    reader = open_gguf(path)
    metadata = reader.metadata
    check_metadata_types(metadata, path)
    _reject_split_files(metadata, path)
    with naming_errors(path, "invalid model hyper-parameters"):
        config = config_from_metadata(metadata, reader, path)
    with naming_errors(path, "invalid tokenizer"):
        tokenizer = tokenizer_from_gguf(metadata)
    names = _hf_names(reader, metadata["general.architecture"], path)
    shapes = dict(kv for t in reader.tensors if names[t.name]
                  for kv in _split_experts(names[t.name], _hf_shape(t), config, path))
    check_weight_shapes(shapes, config, path)
    weight_names = list(shapes)

    def stream(dtype: torch.dtype, keep: frozenset[GGMLQuantizationType]
               ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        return _iter_weights(reader, names, config, dtype, path, keep)

    sizes = [(GGMLQuantizationType(t.tensor_type), int(t.n_elements), int(t.n_bytes))
             for t in reader.tensors if names[t.name] is not None]
    return ModelSource(path=path, format="gguf", config=config, tokenizer=tokenizer,
                       weight_names=weight_names, _stream=stream,
                       tensor_types=frozenset(t for t, _, _ in sizes), tensor_sizes=sizes)


def open_gguf(path: str) -> GGUFFile:
    """The GGUF file at ``path``, parsed (every way that can fail is a ModelLoadError)."""
    if not os.path.exists(path):
        raise ModelLoadError(f"model file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ModelLoadError(f"model path {path!r} is not a file")
    return read_gguf(path)


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name, or None if it has no HF equivalent we know."""
    if match := _LAYER_NAME.fullmatch(name):
        layer, kind, suffix = match.groups()
        module = _ARCH_LAYER_TENSORS.get(arch, {}).get(kind) or _LAYER_TENSORS.get(kind)
        return f"model.layers.{layer}.{module}.{suffix}" if module else None
    if match := _GLOBAL_NAME.fullmatch(name):
        module = _GLOBAL_TENSORS.get(match.group(1))
        return f"{module}.{match.group(2)}" if module else None
    return None


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> HF rotate-half).

    Within each head of ``head_dim`` rows, llama.cpp stores row ``2i`` = HF row ``i`` and
    row ``2i + 1`` = HF row ``i + head_dim / 2``. Works for weights ([rows, in]) and biases.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot un-permute a Q/K tensor of {rows} rows for {n_heads} heads")
    half = rows // n_heads // 2
    heads = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return heads.transpose(1, 2).reshape(weight.shape)


# ============================================================================ metadata

# The types of the metadata keys we read (GGUF writers use several integer widths).
_GENERAL_KEY_TYPES: dict[str, type | tuple[type, type]] = {
    "general.architecture": str, "general.name": str, "split.count": int,
    "tokenizer.ggml.model": str, "tokenizer.ggml.pre": str, "tokenizer.chat_template": str,
    "tokenizer.ggml.tokens": (list, str), "tokenizer.ggml.merges": (list, str),
    "tokenizer.ggml.token_type": (list, int), "tokenizer.ggml.scores": (list, float),
    **{f"tokenizer.ggml.{k}_token_id": int for k in ("bos", "eos", "eot", "eom", "unknown", "padding")},
    **{f"tokenizer.ggml.{k}": bool for k in ("add_bos_token", "add_eos_token", "add_space_prefix")},
}
_ARCH_KEY_TYPES: dict[str, type] = {
    **{k: int for k in ("vocab_size", "context_length", "embedding_length", "feed_forward_length",
                        "block_count", "attention.head_count", "attention.head_count_kv",
                        "attention.key_length", "rope.scaling.original_context_length",
                        "rope.dimension_count", "attention.sliding_window", "expert_count",
                        "expert_used_count", "expert_feed_forward_length",
                        "expert_shared_feed_forward_length")},
    **{k: float for k in ("attention.layer_norm_rms_epsilon", "rope.freq_base",
                          "rope.freq_base_swa", "rope.scaling.factor",
                          "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                          "rope.scaling.attn_factor", "attn_logit_softcapping",
                          "final_logit_softcapping")},
    "rope.scaling.type": str,
    "expert_weights_norm": bool,
}


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        return isinstance(value, bool) or value in (0, 1)
    return isinstance(value, kind)


def check_metadata_types(metadata: dict[str, Any], path: str) -> None:
    """The keys we read hold the types we expect; token-parallel arrays have equal lengths."""
    arch = metadata.get("general.architecture")
    expected = dict(_GENERAL_KEY_TYPES)
    if isinstance(arch, str):
        expected.update({f"{arch}.{k}": t for k, t in _ARCH_KEY_TYPES.items()})
    for key, kind in expected.items():
        value = metadata.get(key)
        if value is None:
            continue
        if isinstance(kind, tuple):
            ok = isinstance(value, list) and all(_is(v, kind[1]) for v in value)
            name = f"an array of {kind[1].__name__}"
        else:
            ok, name = _is(value, kind), f"a {kind.__name__}"
        if not ok:
            found = type(value).__name__ if not isinstance(value, list) else "an array"
            raise ModelLoadError(f"{path!r}: GGUF metadata key {key!r} must be {name}, got {found} "
                                 f"({str(value)[:60]})")
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if metadata.get(key) is not None and len(metadata[key]) != len(tokens):
            raise ModelLoadError(f"{path!r}: GGUF metadata {key!r} has {len(metadata[key])} entries "
                                 f"but there are {len(tokens)} tokens")


def _reject_split_files(metadata: dict[str, Any], path: str) -> None:
    if int(metadata.get("split.count", 1) or 1) > 1:
        raise ModelLoadError(
            f"{path!r} is one part of a split GGUF ({metadata['split.count']} parts); merge the parts "
            f"into one file first (llama.cpp: llama-gguf-split --merge)")


def _require(metadata: dict[str, Any], key: str, path: str) -> Any:
    value = metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{path!r}: required GGUF metadata key {key!r} is missing")
    return value


def _require_positive(metadata: dict[str, Any], key: str, path: str) -> int:
    value = _require(metadata, key, path)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"{path!r}: GGUF metadata key {key!r} must be a positive integer, "
                             f"got {value!r}")
    return value


def config_from_metadata(metadata: dict[str, Any], reader: GGUFFile, path: str) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and tensor list) describes."""
    arch = _require(metadata, "general.architecture", path)
    if arch == "clip":
        raise ModelLoadError(
            f"{path!r} is a multimodal projector (mmproj: a vision encoder, e.g. Gemma 3's), "
            f"not a language model; pagedllm runs text models: load the language model's GGUF "
            f"(e.g. architecture gemma3)")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path!r}: unsupported model architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = _require_positive(metadata, key("embedding_length"), path)
    heads = _require_positive(metadata, key("attention.head_count"), path)
    kv_heads = int(metadata.get(key("attention.head_count_kv")) or heads)
    head_dim = int(metadata.get(key("attention.key_length")) or hidden // heads)
    tensor_names = {t.name for t in reader.tensors}
    eos_ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    o_bias = "blk.0.attn_output.bias" in tensor_names
    layers = _require_positive(metadata, key("block_count"), path)
    fields: dict[str, Any] = dict(
        sliding_window=metadata.get(key("attention.sliding_window")) or None,
        attn_logit_softcapping=metadata.get(key("attn_logit_softcapping")),
        final_logit_softcapping=metadata.get(key("final_logit_softcapping")),
    )
    if arch in ("gemma2", "gemma3"):
        fields.update(_gemma_fields(metadata, arch, layers, hidden // heads, head_dim))
    moe = _moe_fields(metadata, arch)
    return ModelConfig(
        architecture="mixtral" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(metadata, arch, path),
        hidden_size=hidden,
        intermediate_size=_require_positive(metadata, key("feed_forward_length"), path),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(metadata.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        rope_theta=float(metadata.get(key("rope.freq_base"), 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch, reader, path),
        max_position_embeddings=int(metadata.get(key("context_length")) or 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=o_bias,
        qkv_bias=not o_bias and ("blk.0.attn_q.bias" in tensor_names
                                 or "blk.0.attn_qkv.bias" in tensor_names),
        partial_rotary_factor=int(metadata.get(key("rope.dimension_count")) or head_dim) / head_dim,
        **fields,
        **moe,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        name=metadata.get("general.name") or os.path.splitext(os.path.basename(path))[0],
    )


# llama.cpp's Gemma 2 defaults (llama_hparams) where a GGUF gives no value
_GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0}
# block counts llama.cpp takes for the 27B models, whose attention scale differs
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_fields(metadata: dict[str, Any], arch: str, layers: int, hidden_per_head: int,
                  head_dim: int) -> dict[str, Any]:
    """What llama.cpp's Gemma 2/3 loaders take from a GGUF or fix themselves.

    - Sliding layers: the swa pattern (every 2nd / 6th layer global) unless the file gives
      ``attention.sliding_window_pattern``; Gemma 3 without a window has none.
    - Gemma 3's sliding layers take ``rope.freq_base_swa``, else 10000, without scaling.
    - The attention scale is not stored: HF's query_pre_attn_scalar is head_dim, except
      for the 27B models (known by their block count): hidden_size / heads.
    - Soft-caps: Gemma 2's default to 50 (scores) and 30 (logits); Gemma 3 applies no
      score soft-cap, and a logit soft-cap of 0 means none.
    """
    def get(name: str) -> Any:
        value = metadata.get(f"{arch}.{name}")
        return _GEMMA2_DEFAULTS.get(name) if value is None and arch == "gemma2" else value

    window = get("attention.sliding_window") or None
    layer_types = None
    if window is not None:
        pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer, true for a sliding one
            if len(pattern) != layers or not all(_is(p, bool) for p in pattern):
                raise ModelLoadError(f"{arch}.attention.sliding_window_pattern must list a bool "
                                     f"for each of the {layers} layers")
            layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is None or _is(pattern, int):
            layer_types = pattern_layer_types(
                layers, SLIDING_WINDOW_PATTERNS[arch] if pattern is None else pattern)
        else:
            raise ModelLoadError(f"{arch}.attention.sliding_window_pattern must be an integer "
                                 f"or a list of bools, got {str(pattern)[:40]}")
    final_cap = get("final_logit_softcapping")
    return {
        "sliding_window": window,
        "layer_types": layer_types,
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": float(hidden_per_head if layers == _GEMMA_27B_LAYERS[arch]
                                       else head_dim),
        "attn_logit_softcapping": get("attn_logit_softcapping") if arch == "gemma2" else None,
        "final_logit_softcapping": float(final_cap) if final_cap else None,
        "rope_local_theta": (float(metadata.get(f"{arch}.rope.freq_base_swa") or 10000.0)
                             if arch == "gemma3" else None),
    }


def _moe_fields(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mixture-of-experts fields (llama.cpp's MoE architectures have experts in every layer:
    no mlp_only_layers or decoder_sparse_step)."""
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    renormalize = metadata.get(f"{arch}.expert_weights_norm")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(metadata.get(f"{arch}.expert_used_count") or 2),
        "moe_intermediate_size": int(metadata.get(f"{arch}.expert_feed_forward_length")
                                     or metadata[f"{arch}.feed_forward_length"]),
        # where the file does not say, llama.cpp renormalises the top-k weights of Mixtral
        # ("llama") and Qwen3-MoE, not Qwen2-MoE's
        "norm_topk_prob": (arch in ("llama", "qwen3moe") if renormalize is None
                           else bool(renormalize)),
        "shared_expert_intermediate_size": int(
            metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0),
    }


def _vocab_size(metadata: dict[str, Any], arch: str, path: str) -> int:
    """``{arch}.vocab_size`` if the converter wrote it, else the length of the token list."""
    size = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or [])
    if not size:
        raise ModelLoadError(f"{path!r}: neither {arch + '.vocab_size'!r} nor a token list "
                             f"(tokenizer.ggml.tokens) gives the vocabulary size")
    return int(size)


# ============================================================================ rope scaling

def _rope_scaling(metadata: dict[str, Any], arch: str, reader: GGUFFile, path: str) -> dict[str, Any] | None:
    """HF-style rope scaling from ``{arch}.rope.scaling.*`` keys or a ``rope_freqs`` tensor."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return _llama3_scaling_from_freqs(metadata, arch, freqs, path)
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        return _longrope_scaling(metadata, arch, factors, path)
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("attn_factor", "attention_factor")):
        if (value := metadata.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
            scaling[hf_key] = float(value)
    return scaling


def _longrope_scaling(metadata: dict[str, Any], arch: str, factors: dict[str, Any],
                      path: str) -> dict[str, Any]:
    """Phi-3's LongRoPE from llama.cpp's ``rope_factors_{long,short}`` tensors."""
    def values(name: str) -> list[float]:
        tensor = factors.get(f"rope_factors_{name}.weight")
        if tensor is None:
            raise ModelLoadError(f"{path!r}: has a rope_factors tensor but no rope_factors_{name}")
        return dequantize(tensor.data, tensor.tensor_type, [int(tensor.n_elements)],
                          tensor.name).tolist()

    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if not original:
        raise ModelLoadError(f"{path!r}: LongRoPE factors need "
                             f"{arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": values("long"),
                               "short_factor": values("short"),
                               "original_max_position_embeddings": int(original)}
    if (attn_factor := metadata.get(f"{arch}.rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def _llama3_scaling_from_freqs(metadata: dict[str, Any], arch: str, tensor: Any, path: str) -> dict[str, Any] | None:
    """Recover Llama 3.x rope scaling parameters from llama.cpp's ``rope_freqs`` tensor.

    The converter does not store Llama 3's ``rope_scaling`` dict; it stores the per-frequency
    divisors it implies: 1 for high frequencies, ``factor`` for low ones, and in between
    ``1 / ((1 - s) / factor + s)`` with ``s`` linear in ``original_ctx / wavelength``. Only the
    wavelength thresholds are identifiable, so ``original_max_position_embeddings`` is
    taken from metadata or Llama 3's 8192; the other two parameters follow from the
    in-between values. The result is checked by recomputing the divisors.
    """
    divisors = dequantize(tensor.data, tensor.tensor_type, [int(tensor.n_elements)], tensor.name).double()
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    dim = 2 * divisors.numel()
    original = int(metadata.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    x = original * theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim) / (2 * math.pi)
    middle = (divisors > 1.0 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if int(middle.sum()) < 2:
        raise ModelLoadError(f"{path!r}: cannot infer llama3 rope scaling from rope_freqs "
                             f"(fewer than two interpolated frequencies)")
    smooth = (1.0 / divisors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(x[middle].numpy(), smooth.numpy(), 1)
    low, high = -intercept / slope, (1.0 - intercept) / slope
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(round(low, 4)),
               "high_freq_factor": float(round(high, 4)), "original_max_position_embeddings": original}
    if not torch.allclose(llama3_rope_divisors(scaling, theta, dim), divisors, rtol=1e-3):
        raise ModelLoadError(f"{path!r}: rope_freqs tensor does not follow llama3 rope scaling")
    return scaling


def llama3_rope_divisors(scaling: dict[str, Any], theta: float, dim: int) -> torch.Tensor:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs`` for Llama 3 rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    smooth = (original / wavelength - low) / (high - low)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelength < original / high, torch.ones_like(divisors), divisors)
    return torch.where(wavelength > original / low, torch.full_like(divisors, factor), divisors)


# ============================================================================ weights

def _hf_names(reader: GGUFFile, arch: str, path: str) -> dict[str, str | None]:
    """GGUF tensor name -> HF name (None for tensors only used for the config)."""
    names: dict[str, str | None] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None and tensor.name not in _CONFIG_ONLY_TENSORS:
            raise ModelLoadError(f"{path!r}: tensor {tensor.name!r} has no counterpart in the supported "
                                 f"architectures ({', '.join(SUPPORTED_ARCHITECTURES)})")
        names[tensor.name] = hf_name
    return names


def _split_experts(hf_name: str, shape: tuple[int, ...], config: ModelConfig,
                   path: str) -> list[tuple[str, tuple[int, ...]]]:
    """A stacked experts tensor [E, rows, cols] as its E per-expert names and shapes; any
    other tensor as itself."""
    if _PER_EXPERT not in hf_name:
        return [(hf_name, shape)]
    if len(shape) != 3 or shape[0] != config.num_experts:
        raise ModelLoadError(f"{path!r}: stacked experts tensor for {hf_name!r} has shape "
                             f"{list(shape)}; the model needs [{config.num_experts}, rows, cols]")
    return [(hf_name.replace(_PER_EXPERT, str(e)), shape[1:]) for e in range(shape[0])]


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's logical shape in HF (row-major) order: GGUF's ``ne`` reversed."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _iter_weights(reader: GGUFFile, names: dict[str, str | None], config: ModelConfig,
                  dtype: torch.dtype, path: str, keep: frozenset[GGMLQuantizationType]
                  ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    for tensor in reader.tensors:
        hf_name = names[tensor.name]
        if hf_name is None:
            continue
        shape = _hf_shape(tensor)
        with naming_errors(path, "cannot read weights"):
            if tensor.tensor_type in keep and len(shape) == (3 if _PER_EXPERT in hf_name else 2):
                rows = quantized_rows(tensor.data, tensor.tensor_type,
                                      (math.prod(shape[:-1]), shape[-1]), tensor.name)
                if _PER_EXPERT in hf_name:  # stacked experts [E, rows, cols]: one each
                    for expert, part in enumerate(rows.chunk(shape[0])):
                        yield (hf_name.replace(_PER_EXPERT, str(expert)),
                               GGUFWeight(tensor.tensor_type, part, shape[-1]))
                else:
                    yield hf_name, GGUFWeight(tensor.tensor_type,
                                              _to_hf_layout(rows, tensor.name, config), shape[1])
                continue
            weight = dequantize(tensor.data, tensor.tensor_type, shape, tensor.name)
            weight = _to_hf_layout(weight, tensor.name, config).to(dtype)
        if _PER_EXPERT in hf_name:
            for expert, part in enumerate(weight):
                yield hf_name.replace(_PER_EXPERT, str(expert)), part
        else:
            yield hf_name, weight


def _to_hf_layout(weight: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    if config.architecture in _NORM_PLUS_ONE_ARCHITECTURES:
        return weight - 1.0 if name.endswith("norm.weight") else weight
    if config.architecture not in ("llama", "mistral", "mixtral"):
        return weight
    if ".attn_q." in name:
        return unpermute_rope_rows(weight, config.num_attention_heads)
    if ".attn_k." in name:
        return unpermute_rope_rows(weight, config.num_key_value_heads)
    return weight
