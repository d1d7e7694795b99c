"""Loading a model from an HF transformers directory (config.json + *.safetensors + tokenizer)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from pagedllm.models.config import ModelConfig, pattern_layer_types
from pagedllm.models.registry import (HF_ARCHITECTURES, HF_MODEL_TYPES, QKV_BIAS_ARCHITECTURES,
                                      SLIDING_WINDOW_PATTERNS, UNSUPPORTED_HF_ARCHITECTURES,
                                      UNSUPPORTED_HF_MODEL_TYPES)
from pagedllm.tokenizer import Tokenizer

from .errors import ModelLoadError, naming_errors
from .hf_tokenizer import tokenizer_from_hf_dir
from .source import ModelSource
from .validate import check_weight_shapes

_INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes a weight may have (integers or bools would be cast silently)
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def load_hf_dir(path: str) -> ModelSource:
    """Open an HF model directory; weights are read lazily, one tensor at a time.

    Raises:
        ModelLoadError: no config.json, unsupported architecture, missing keys or
            safetensors files.
    """
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    hf_config = _read_config(path)
    _architecture(hf_config, path)  # fail on the architecture before looking for weights
    files = safetensors_files(path)
    shapes = _tensor_shapes(files)
    names = list(shapes)
    with naming_errors(path, "invalid config.json"):
        config = config_from_hf(hf_config, path, has_lm_head="lm_head.weight" in shapes)
    check_weight_shapes(shapes, config, path)
    with naming_errors(path, "invalid tokenizer"):
        tokenizer = tokenizer_from_hf_dir(path)
    _share_eos_ids(config, tokenizer)

    def stream(dtype: torch.dtype, keep: frozenset) -> Iterator[tuple[str, torch.Tensor]]:
        return _iter_weights(files, dtype)

    return ModelSource(path=path, format="hf", config=config, tokenizer=tokenizer,
                       weight_names=names, _stream=stream)


def _share_eos_ids(config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Give config and tokenizer the same stop ids: config.json's, generation_config's, the tokenizer's."""
    merged = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    config.eos_token_ids = merged
    tokenizer.eos_token_ids = list(merged)


def config_from_hf(hf: dict[str, Any], path: str, has_lm_head: bool = True) -> ModelConfig:
    """A ModelConfig from a transformers ``config.json`` dict (4.x or 5.x layout)."""
    arch = _architecture(hf, path)

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ModelLoadError(f"{path!r}: config.json has no {key!r}")
        value = hf[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"{path!r}: config.json {key!r} must be a positive integer, "
                                 f"got {value!r}")
        return value

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    layers = int(need("num_hidden_layers"))
    rope_theta, rope_scaling, rope_extra = _rope(hf)
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path!r}: bidirectional attention (an embedding model, e.g. "
                             f"EmbeddingGemma) is not supported; pagedllm runs causal decoders")
    eos = hf.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) or not has_lm_head,
        attention_bias=bool(hf.get("attention_bias", False)),
        qkv_bias=arch in QKV_BIAS_ARCHITECTURES,
        hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
        sliding_window=_sliding_window(hf),
        layer_types=_layer_types(arch, hf, layers),
        partial_rotary_factor=float(rope_extra.get("partial_rotary_factor")
                                    or hf.get("partial_rotary_factor") or 1.0),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
        # HF's Gemma 3 attention never applies a soft-cap its config may name (nor llama.cpp's)
        attn_logit_softcapping=None if arch == "gemma3" else hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        rope_local_theta=rope_extra.get("rope_local_theta") or _DEFAULT_LOCAL_THETA.get(arch),
        **_moe_fields(hf, arch),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None],
        name=hf.get("_name_or_path") or os.path.basename(os.path.normpath(path)),
    )


# HF's rope base of Gemma 3's sliding layers where a config names none
_DEFAULT_LOCAL_THETA = {"gemma3": 10000.0}


def _layer_types(arch: str, hf: dict[str, Any], layers: int) -> list[str] | None:
    """config.json's layer_types; a 4.x Gemma config has none, and HF derives them from
    Gemma 3's sliding_window_pattern (default 6) or Gemma 2's alternation."""
    if hf.get("layer_types") is not None or arch not in SLIDING_WINDOW_PATTERNS:
        return hf.get("layer_types")
    pattern = (hf.get("sliding_window_pattern") if arch == "gemma3" else None) \
        or SLIDING_WINDOW_PATTERNS[arch]
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ModelLoadError(f"config.json 'sliding_window_pattern' must be a positive integer, "
                             f"got {pattern!r}")
    return pattern_layer_types(layers, pattern)


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window, where the config turns it on (Qwen2 sets one but use_sliding_window False)."""
    if hf.get("use_sliding_window") is False:
        return None
    return int(hf["sliding_window"]) if hf.get("sliding_window") else None


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mixture-of-experts fields (4.x and 5.x names; Mixtral's experts are intermediate_size
    wide and renormalise their top-k weights)."""
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if not experts:
        return {}
    mixtral = arch == "mixtral"
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 2),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", mixtral)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in hf.get("mlp_only_layers") or []],
    }


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: those the shard index lists, else all in the dir."""
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index_path):
        files = [os.path.join(path, name) for name in _shard_names(index_path)]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{path!r}: shards listed in {_INDEX_FILE} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path!r} has no *.safetensors weights (other weight formats are not supported)")
    return files


def _shard_names(index_path: str) -> list[str]:
    """The shard file names of a safetensors index: plain names inside the model directory."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise ValueError("'weight_map' is not an object")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot parse {index_path!r}: {exc}") from exc
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ModelLoadError(f"{index_path!r}: shard {name!r} is not a file name inside the "
                                 f"model directory")
    return names


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path!r} has no config.json (not an HF model directory)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot parse {config_path!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path!r} must hold a JSON object, not {type(config).__name__}")
    return config


def _architecture(hf: dict[str, Any], path: str) -> str:
    names = hf.get("architectures")
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = hf.get("model_type")
    refused = [n for n in names if n in UNSUPPORTED_HF_ARCHITECTURES]
    if not names and isinstance(model_type, str) and model_type in UNSUPPORTED_HF_MODEL_TYPES:
        refused = [UNSUPPORTED_HF_MODEL_TYPES[model_type]]
    if refused:
        raise ModelLoadError(f"{path!r} is {UNSUPPORTED_HF_ARCHITECTURES[refused[0]]}")
    if isinstance(model_type, str) and model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    found = hf.get("architectures") or hf.get("model_type")
    raise ModelLoadError(f"{path!r}: unsupported architecture {str(found)[:80]!r} "
                         f"(supported: {', '.join(HF_ARCHITECTURES)})")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, dict[str, Any]]:
    """(rope_theta, HF-style rope_scaling, other rope fields) from 4.x ``rope_theta`` /
    ``rope_scaling`` or 5.x ``rope_parameters``, which Gemma 3 keys by layer type (its
    sliding layers' base is the other fields' ``rope_local_theta``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    extra: dict[str, Any] = {}
    if "full_attention" in params:  # per layer type
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling on sliding layers ({local['rope_type']!r}) is not "
                             f"supported")
        extra["rope_local_theta"] = local.get("rope_theta")
        params = dict(params["full_attention"])
    elif hf.get("rope_local_base_freq"):
        extra["rope_local_theta"] = float(hf["rope_local_base_freq"])
    if "partial_rotary_factor" in params:
        extra["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None)
    params.pop("type", None)
    if kind in (None, "default"):
        return theta, None, extra
    if kind == "longrope" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = hf.get("original_max_position_embeddings")
    return theta, {"rope_type": kind, **params}, extra


def _tensor_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the shards, read from their headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    dtype = tensor.get_dtype()
                    if dtype not in _FLOAT_DTYPES:
                        raise ModelLoadError(f"{file!r}: tensor {name!r} has dtype {dtype}; weights "
                                             f"must be one of {', '.join(_FLOAT_DTYPES)}")
                    if name in shapes:
                        raise ModelLoadError(f"{file!r}: tensor {name!r} is also in another shard")
                    shapes[name] = tuple(tensor.get_shape())
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types on bad headers
            raise ModelLoadError(f"cannot read safetensors file {file!r}: {exc}") from exc
    return shapes


def _iter_weights(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)
        except Exception as exc:  # e.g. the file changed or was cut since it was opened
            raise ModelLoadError(f"cannot read weights from {file!r}: {exc}") from exc
