"""Dequantization of GGUF (ggml) tensor data to float32 torch tensors.

Each ggml quantization type stores a tensor as a sequence of fixed-size blocks; a block
holds ``block_size`` consecutive elements of a row in ``type_size`` bytes (scales as
little-endian f16, then packed integer quants). The functions below unpack a whole
tensor at once with vectorised torch ops: the raw bytes are viewed as an
``[n_blocks, type_size]`` uint8 matrix, each field is a column slice of it, and each
function returns ``[n_blocks, block_size]`` float32 values.

The arithmetic is done in float32 in the same order as ggml's reference dequantizers
(e.g. ``(d * sc) * q - dmin * m`` for Q4_K), so results are bit-identical to
``gguf.quants.dequantize``. The float steps run in place on the one output buffer: fresh
large allocations (page faults) dominate the cost otherwise.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelLoadError

QK_K = 256  # elements per "super-block" of the k-quants

_Dequantizer = Callable[[torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- helpers

def _f16_column(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 stored at byte ``offset`` of every block, as [n, 1] float32."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(*values: int, shape: Sequence[int]) -> torch.Tensor:
    """A uint8 tensor of shift amounts, shaped to broadcast against packed bytes."""
    return torch.tensor(values, dtype=torch.uint8).view(*shape)


def _nibbles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Unpack 4-bit quants: each run of ``group`` bytes yields its low nibbles, then its high ones.

    [n, k] bytes -> [n, 2k] values (uint8).
    """
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, group) >> _shifts(0, 4, shape=(1, 1, 2, 1))
    return runs.bitwise_and_(0x0F).reshape(n, -1)


def _bit_planes(packed: torch.Tensor) -> torch.Tensor:
    """Bit b of byte l becomes element ``b * n_bytes + l``: [n, k] bytes -> [n, 8k] bits."""
    n = packed.shape[0]
    planes = packed.reshape(n, 1, -1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    return (planes & 1).reshape(n, -1)


def _bits_little_endian(packed: torch.Tensor) -> torch.Tensor:
    """The bits of a little-endian integer, lowest first: [n, k] bytes -> [n, 8k] bits."""
    n = packed.shape[0]
    bits = packed.reshape(n, -1, 1) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
    return (bits & 1).reshape(n, -1)


def _crumbs(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Unpack 2-bit fields: each run of ``group`` bytes yields bits 0-1, 2-3, 4-5 then 6-7.

    [n, k] bytes -> [n, 4k] values (uint8, 0..3).
    """
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, group) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))
    return (runs & 0x03).reshape(n, -1)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the 12-byte scale field of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7
    (high nibble).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=1)
    return scales.to(torch.float32), mins.to(torch.float32)


# ----------------------------------------------------------------------------- float types

def _dequant_f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.reshape(-1).view(torch.float32).view(-1, 1)


def _dequant_f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.reshape(-1).view(torch.float16).to(torch.float32).view(-1, 1)


def _dequant_bf16(raw: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an f32: shift the bits into place (exact, NaN payloads kept)
    bits = raw.reshape(-1).view(torch.int16).to(torch.int32) << 16
    return bits.view(torch.float32).view(-1, 1)


# ----------------------------------------------------------------------------- legacy quants (32 elements/block)

def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_column(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q.mul_(d)


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_column(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.float32).sub_(8.0)
    return q.mul_(d)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16_column(blocks, 0), _f16_column(blocks, 2)
    q = _nibbles(blocks[:, 4:], 16).to(torch.float32)
    return q.mul_(d).add_(m)


def _five_bit_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 quants: low 4 bits from ``qs`` nibbles, 5th bit from the 32-bit ``qh``."""
    return _nibbles(qs, 16) | (_bits_little_endian(qh) << 4)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_column(blocks, 0)
    q = _five_bit_quants(blocks[:, 2:6], blocks[:, 6:]).to(torch.float32).sub_(16.0)
    return q.mul_(d)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16_column(blocks, 0), _f16_column(blocks, 2)
    q = _five_bit_quants(blocks[:, 4:8], blocks[:, 8:]).to(torch.float32)
    return q.mul_(d).add_(m)


# ----------------------------------------------------------------------------- k-quants (256 elements/block)

def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    d, dmin = _f16_column(blocks, 80), _f16_column(blocks, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (dmin * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    q = _crumbs(qs, 32).to(torch.float32).reshape(n, 16, 16)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """16 six-bit signed scales: low nibbles from bytes 0-7, top 2 bits from bytes 8-11."""
    n = packed.shape[0]
    low = _nibbles(packed[:, 0:8], 8)
    high = (packed[:, 8:12].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1))) & 0x03
    six_bit = low | (high.reshape(n, 16) << 4)
    return six_bit.to(torch.float32) - 32.0


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16_column(blocks, 108)
    dl = (d * _q3_k_scales(scales)).unsqueeze(-1)
    low = _crumbs(qs, 32).to(torch.int16)
    # a cleared high bit means "subtract 4" (the quant is signed, -4..3)
    high_cleared = (1 - _bit_planes(hmask)).to(torch.int16)
    q = (low - 4 * high_cleared).to(torch.float32).reshape(n, 16, 16)
    return q.mul_(dl).reshape(n, QK_K)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16_column(blocks, 0), _f16_column(blocks, 2)
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    dl, ml = (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)
    q = _nibbles(blocks[:, 16:144], 32).to(torch.float32).reshape(n, 8, 32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16_column(blocks, 0), _f16_column(blocks, 2)
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    dl, ml = (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)
    qh, qs = blocks[:, 16:48], blocks[:, 48:176]
    q = (_nibbles(qs, 32) | (_bit_planes(qh) << 4)).to(torch.float32).reshape(n, 8, 32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16_column(blocks, 208)
    dl = (d * scales).unsqueeze(-1)
    six_bit = _nibbles(ql, 64) | (_crumbs(qh, 32) << 4)
    q = six_bit.to(torch.float32).sub_(32.0).reshape(n, 16, 16)
    return q.mul_(dl).reshape(n, QK_K)


_DEQUANTIZERS: dict[GGMLQuantizationType, _Dequantizer] = {
    GGMLQuantizationType.F32: _dequant_f32,
    GGMLQuantizationType.F16: _dequant_f16,
    GGMLQuantizationType.BF16: _dequant_bf16,
    GGMLQuantizationType.Q8_0: _dequant_q8_0,
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: _dequant_q4_1,
    GGMLQuantizationType.Q5_0: _dequant_q5_0,
    GGMLQuantizationType.Q5_1: _dequant_q5_1,
    GGMLQuantizationType.Q2_K: _dequant_q2_k,
    GGMLQuantizationType.Q3_K: _dequant_q3_k,
    GGMLQuantizationType.Q4_K: _dequant_q4_k,
    GGMLQuantizationType.Q5_K: _dequant_q5_k,
    GGMLQuantizationType.Q6_K: _dequant_q6_k,
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_DEQUANTIZERS)


# ----------------------------------------------------------------------------- public API

def _type_name(qtype: object) -> str:
    return getattr(qtype, "name", str(qtype))


def _raw_bytes(data: np.ndarray | bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor's bytes as a flat, owned uint8 torch tensor.

    Copies: reader data is usually a read-only view of a memory-mapped file, which torch
    cannot wrap without warnings and which must not outlive the file.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        array = np.frombuffer(data, dtype=np.uint8)
    else:
        array = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return torch.from_numpy(array.copy())


def dequantize(
    data: np.ndarray | bytes | bytearray | memoryview,
    qtype: GGMLQuantizationType | int,
    shape: Sequence[int],
    name: str = "<unnamed>",
) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32.

    Args:
        data: the tensor's raw data, as ``gguf.GGUFReader`` exposes it (``ReaderTensor.data``:
            a float array for F32/F16, otherwise uint8 bytes) or as plain bytes.
        qtype: its ggml type.
        shape: the logical shape in row-major (HF/torch) order, i.e. GGUF's ``ne`` reversed;
            the last dimension is the one quantized in blocks.
        name: the tensor's name, used in error messages.

    Returns:
        A new float32 tensor of ``shape``.

    Raises:
        ModelLoadError: unsupported type, or data whose size does not match the shape.
    """
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ModelLoadError(f"tensor {name!r} has unknown ggml type id {qtype}") from None
    dequantizer = _DEQUANTIZERS.get(qtype)
    if dequantizer is None:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelLoadError(
            f"tensor {name!r} uses ggml type {_type_name(qtype)}, which pagedllm cannot dequantize "
            f"(supported: {supported})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(dim) for dim in shape)
    blocks = _as_blocks(_raw_bytes(data), shape, block_size, type_size, qtype, name)
    return dequantizer(blocks).reshape(shape)


def _as_blocks(raw: torch.Tensor, shape: tuple[int, ...], block_size: int, type_size: int,
               qtype: GGMLQuantizationType, name: str) -> torch.Tensor:
    """Check the byte count against ``shape`` and view the bytes as [n_blocks, type_size]."""
    n_elements = int(np.prod(shape)) if shape else 1
    if shape and shape[-1] % block_size:
        raise ModelLoadError(
            f"tensor {name!r} ({qtype.name}, shape {list(shape)}): row length {shape[-1]} is not a "
            f"multiple of the {qtype.name} block size {block_size}")
    expected = n_elements // block_size * type_size
    if raw.numel() != expected:
        raise ModelLoadError(
            f"tensor {name!r} ({qtype.name}, shape {list(shape)}) should hold {expected} bytes but "
            f"has {raw.numel()}: the file is truncated or corrupt")
    return raw.view(-1, type_size)


def quantized_rows(data: np.ndarray | bytes | bytearray | memoryview,
                   qtype: GGMLQuantizationType, shape: Sequence[int],
                   name: str = "<unnamed>") -> torch.Tensor:
    """A 2-D quantized tensor's bytes, checked against ``shape`` ([rows, cols]), as uint8
    [rows, bytes per row]: row r's blocks in order (an owned copy)."""
    shape = tuple(int(dim) for dim in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = _as_blocks(_raw_bytes(data), shape, block_size, type_size, qtype, name)
    return blocks.reshape(shape[0], shape[1] // block_size * type_size)
