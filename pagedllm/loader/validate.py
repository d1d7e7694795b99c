"""Checks that a model file describes a model we can build, before anything is allocated.

A hostile or corrupt file can declare hyper-parameters that do not match its tensors
(the layer loaders would then silently copy a slice of a larger tensor) or that are
absurd (a context length of 2**40 makes the rotary cache an out-of-memory
attempt). So, before the model is built:

* the declared hyper-parameters must be sane (ModelConfig validates them),
* every weight the architecture needs must be in the file with exactly the shape the
  hyper-parameters imply, and nothing else may be,
* the model (weights + buffers) must fit in the memory that is available.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from pagedllm.models.config import ModelConfig
from pagedllm.models.registry import model_class

from .errors import ModelLoadError

# checkpoint entries models may carry that have no parameter (older HF Llama checkpoints)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight a checkpoint of config's architecture must hold."""
    return model_class(config).checkpoint_shapes(config)  # type: ignore[attr-defined]


def check_weight_shapes(declared: Mapping[str, Sequence[int]], config: ModelConfig, path: str) -> None:
    """Every expected weight present with its exact shape, and no unknown one."""
    if config.num_hidden_layers > len(declared):  # before enumerating a hostile layer count
        raise ModelLoadError(f"{path!r}: the model declares {config.num_hidden_layers} layers but "
                             f"the file holds only {len(declared)} tensors")
    if 3 * config.num_experts > len(declared):  # each expert has 3 tensors in a MoE layer
        raise ModelLoadError(f"{path!r}: the model declares {config.num_experts} experts but the "
                             f"file holds only {len(declared)} tensors")
    expected = expected_weight_shapes(config)
    for name, shape in declared.items():
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if name not in expected:
            raise ModelLoadError(f"{path!r}: tensor {name!r} is not part of a {config.architecture} "
                                 f"model with {config.num_hidden_layers} layers")
        if tuple(shape) != expected[name]:
            raise ModelLoadError(
                f"{path!r}: tensor {name!r} has shape {list(shape)}, but the model's "
                f"hyper-parameters need {list(expected[name])}")
    missing = [name for name in expected if name not in declared]
    if missing:
        raise ModelLoadError(f"{path!r}: {len(missing)} weights the model needs are missing, "
                             f"e.g. {missing[:3]}")


def weight_numel(config: ModelConfig) -> int:
    """Elements of the checkpoint's weights (a tied LM head counted once): its size in bytes
    per element, as check_weight_shapes has checked the file's headers against these."""
    return sum(math.prod(shape) for shape in expected_weight_shapes(config).values())


def model_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the built model holds in ``dtype``: its weights plus the cos/sin caches
    ([max_position, head_dim] each) of the rotary embedding its layers share (Gemma 3: two,
    one for its sliding layers' base).

    Computed, not measured: building the model on the meta device would be exact but costs
    seconds the first time (torch loads its meta kernels). A test checks it against a real
    model's parameters and buffers.
    """
    numel = weight_numel(config)
    rotary = 2 * config.max_position_embeddings * config.head_dim
    rotary *= 2 if config.rope_local_theta is not None else 1
    return (numel + rotary) * dtype.itemsize


def _size(nbytes: int) -> str:
    """1.5 MiB, 3.8 GiB: a one-block KV cache read "0.00 GiB"."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_fits_in_memory(config: ModelConfig, dtype: torch.dtype, available: int, path: str,
                         kv_bytes: int = 0, kept: tuple[int, int] = (0, 0)) -> None:
    """Refuse, before allocating, a model that cannot fit in ``available`` bytes: its weights
    and buffers in ``dtype`` (each held once) plus ``kv_bytes``, the least KV cache the engine
    runs with.
    kept: (elements, file bytes) of a GGUF's weights kept quantized, held as their packing
    (at most 1.05x the file's bytes) instead of in ``dtype``."""
    elements, file_bytes = kept
    weights = model_bytes(config, dtype) - elements * dtype.itemsize + int(file_bytes * 1.05)
    if weights + kv_bytes > available:
        kv = f" and {_size(kv_bytes)} of KV cache at the least" if kv_bytes else ""
        raise ModelLoadError(
            f"{path!r}: the model needs {weights / 2**30:.1f} GiB of weights{kv} "
            f"({str(dtype).removeprefix('torch.')}, {config.num_hidden_layers} layers, context "
            f"{config.max_position_embeddings}), {available / 2**30:.1f} GiB available")
