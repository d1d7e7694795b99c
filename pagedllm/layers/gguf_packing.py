"""GGUF quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) packed for the CPU kernel
kernels/csrc/gguf_linear.cpp, which computes with their exact values.

The layout is described in gguf_linear.cpp's header. In short: outputs in groups of 16
(padded to an even number of groups), groups in panels of 4, a panel block after block;
a panel's block holds its groups' scales (16 outputs side by side per field), then for each
32 inputs each group's quants as 16-bit words of 4 nibbles (plus a bit plane for Q5_K, a
2-bit plane for Q6_K; Q8_0 keeps its bytes). The K-quants keep their 6- or 8-bit scales as
integers. The packed form is 1.00-1.03x the GGUF's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.kernels import ops

Q = GGMLQuantizationType
GROUP = 16          # outputs per group: one vector of fp32 sums in the kernel
PANEL_GROUPS = 4    # groups side by side in a panel
UNIT = 32           # inputs per unit of quants


@dataclass(frozen=True)
class _Format:
    block: int   # inputs per block
    header: int  # bytes of one group's scales per block
    unit: int    # bytes of one group's quants per 32 inputs


_FORMATS: dict[GGMLQuantizationType, _Format] = {
    Q.Q4_0: _Format(32, 32, 256),
    Q.Q4_1: _Format(32, 64, 256),
    Q.Q8_0: _Format(32, 32, 512),
    Q.Q4_K: _Format(256, 320, 256),
    Q.Q5_K: _Format(256, 320, 320),
    Q.Q6_K: _Format(256, 288, 384),
}
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_FORMATS)


def _format(qtype: GGMLQuantizationType, n: int, k: int) -> _Format:
    if qtype not in _FORMATS:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"the GGUF kernel takes {names}, not {getattr(qtype, 'name', qtype)}")
    f = _FORMATS[qtype]
    if n <= 0 or k <= 0 or k % f.block:
        raise ValueError(f"cannot pack a {qtype.name} weight [{n}, {k}]: K must be a positive "
                         f"multiple of {f.block}")
    return f


def can_pack(qtype: GGMLQuantizationType, k: int) -> bool:
    """Whether the kernel takes a weight of qtype with k inputs (any number of outputs)."""
    return qtype in _FORMATS and k > 0 and k % _FORMATS[qtype].block == 0


def _groups(n: int) -> int:
    return -(-n // (2 * GROUP)) * 2


def packed_nbytes(qtype: GGMLQuantizationType, n: int, k: int) -> int:
    """Bytes of the packed form of a [n, k] weight of qtype."""
    f = _format(qtype, n, k)
    return _groups(n) * (k // f.block) * (f.header + f.block // UNIT * f.unit)


def gguf_nbytes(qtype: GGMLQuantizationType, n: int, k: int) -> int:
    """Bytes the GGUF file holds for a [n, k] weight of qtype."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    return n * k // block * type_size


def pack_gguf(qtype: GGMLQuantizationType, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The GGUF bytes of a weight [n, k] (uint8 [n, bytes per row], row by row as the file
    holds them) in gguf_linear's layout: a flat uint8 tensor of packed_nbytes bytes
    (kernels/csrc/gguf_pack.cpp: the blocks' fields copied into place, threads over panels)."""
    f = _format(qtype, n, k)
    type_size = GGML_QUANT_SIZES[qtype][1]
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (n, k // f.block * type_size):
        raise ValueError(f"{qtype.name} weight [{n}, {k}]: raw must be uint8 "
                         f"[{n}, {k // f.block * type_size}], got {raw.dtype} {list(raw.shape)}")
    return ops.gguf_pack(raw.contiguous(), int(qtype), n, k)


def dequantize_packed_rows(packed: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int,
                           rows: torch.Tensor) -> torch.Tensor:
    """The exact float32 weights of the given output rows [len(rows), k], read from the
    packed form (gguf.quants.dequantize's values bit for bit): a tied embedding's lookup."""
    _format(qtype, n, k)
    return ops.gguf_dequantize_rows(packed, int(qtype), n, k, rows)
