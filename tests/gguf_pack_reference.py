"""The layout of gguf_linear.cpp built with torch ops on whole tensors: an independent
reference for the C++ packer (kernels/csrc/gguf_pack.cpp), which copies field by field.
(pagedllm packed this way until 2026-11-25; a Llama-3-8B Q4_K_M file took ~50 s.)"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.layers.gguf_packing import GROUP, PANEL_GROUPS, UNIT, _format, _groups, packed_nbytes

Q = GGMLQuantizationType
CHUNK_PANELS = 16   # panels packed at a time: the transient tensors stay small


def reference_pack(qtype: GGMLQuantizationType, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    f = _format(qtype, n, k)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = k // f.block
    panel_bytes = PANEL_GROUPS * blocks * (f.header + f.block // UNIT * f.unit)
    out = torch.empty(packed_nbytes(qtype, n, k), dtype=torch.uint8)
    groups = _groups(n)
    for g0 in range(0, groups, PANEL_GROUPS * CHUNK_PANELS):
        g1 = min(groups, g0 + PANEL_GROUPS * CHUNK_PANELS)
        rows = raw[g0 * GROUP:g1 * GROUP]
        if rows.shape[0] < (g1 - g0) * GROUP:  # the padding outputs: all-zero blocks
            rows = torch.cat([rows, rows.new_zeros((g1 - g0) * GROUP - rows.shape[0],
                                                   rows.shape[1])])
        header, units = _split(qtype, rows.reshape(-1, blocks, type_size))
        full = (g1 - g0) // PANEL_GROUPS * PANEL_GROUPS  # the last panel may have 2 groups
        start = g0 // PANEL_GROUPS * panel_bytes
        for a, b in ((0, full), (full, g1 - g0)):
            if b > a:
                size = (b - a) * panel_bytes // PANEL_GROUPS
                _interleave(header[a:b], units[a:b], min(PANEL_GROUPS, b - a),
                            out[start:start + size])
                start += size
    return out


def _interleave(header: torch.Tensor, units: torch.Tensor, panel_groups: int,
                out: torch.Tensor) -> None:
    """Per-group headers [groups, blocks, H] and units [groups, blocks, units, U] written into
    out as panels of panel_groups: each block, its groups' headers then unit by unit its
    groups' quants."""
    groups, blocks, h = header.shape
    nu, u = units.shape[2:]
    p, g = groups // panel_groups, panel_groups
    view = out.view(p, blocks, g * (h + nu * u))
    view[:, :, :g * h].view(p, blocks, g, h).copy_(header.reshape(p, g, blocks, h).transpose(1, 2))
    view[:, :, g * h:].view(p, blocks, nu, g, u).copy_(
        units.reshape(p, g, blocks, nu, u).permute(0, 2, 3, 1, 4))


def _split(qtype: GGMLQuantizationType, b: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks [rows, blocks, type size] (rows a multiple of 16) -> each group's header
    [groups, blocks, H] and units [groups, blocks, units, U] (uint8)."""
    if qtype == Q.Q8_0:
        q = b[..., 2:34]
        g, blocks = b.shape[0] // GROUP, b.shape[1]
        # [group, o, block, pair, e] -> [group, block, pair, o, e]
        units = q.reshape(g, GROUP, blocks, 16, 2).permute(0, 2, 3, 1, 4).reshape(g, blocks, 1, 512)
        return _per_output(b[..., 0:2]), units
    if qtype in (Q.Q4_0, Q.Q4_1):
        qs = b[..., -16:]
        q = torch.cat([qs & 0x0F, qs >> 4], -1)
        header = _per_output(b[..., 0:2]) if qtype == Q.Q4_0 else \
            torch.cat([_per_output(b[..., 0:2]), _per_output(b[..., 2:4])], -1)
        return header, _nibble_runs(q)
    if qtype == Q.Q6_K:
        ql, qh = b[..., 0:128], b[..., 128:192]
        low = _runs_of(ql, 64, (0, 4), 0x0F)    # each 64 bytes: low nibbles, then high
        high = _runs_of(qh, 32, (0, 2, 4, 6), 0x03)
        header = torch.cat([_per_output(b[..., 208:210]), _per_output(b[..., 192:208])], -1)
        return header, torch.cat([_nibble_runs(low), _high_planes(high, 2)], -1)
    # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, [qh,] qs
    a, m, c = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (c >> 4) | ((m >> 2) & 0x30)], -1)
    header = torch.cat([_per_output(b[..., 0:2]), _per_output(b[..., 2:4]), _per_output(sc),
                        _per_output(mn)], -1)
    if qtype == Q.Q4_K:
        return header, _nibble_runs(_runs_of(b[..., 16:144], 32, (0, 4), 0x0F))
    low = _runs_of(b[..., 48:176], 32, (0, 4), 0x0F)
    high = _runs_of(b[..., 16:48], 32, tuple(range(8)), 0x01)  # bit j of byte l: 32 j + l
    return header, torch.cat([_nibble_runs(low), _high_planes(high, 1)], -1)


def _per_output(field: torch.Tensor) -> torch.Tensor:
    """A field of F bytes per block [rows, blocks, F] -> [groups, blocks, F * 16]: each byte
    (fp16 fields: each value) of the group's 16 outputs side by side."""
    rows, blocks, width = field.shape
    if width == 2:  # one fp16: its 2 bytes stay together
        return field.reshape(rows // GROUP, GROUP, blocks, 2).transpose(1, 2) \
            .reshape(rows // GROUP, blocks, 2 * GROUP)
    return field.reshape(rows // GROUP, GROUP, blocks, width).permute(0, 2, 3, 1) \
        .reshape(rows // GROUP, blocks, width * GROUP)


def _runs_of(packed: torch.Tensor, run: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Bit fields of runs of `run` bytes, each run giving its bytes' field at shifts[0] in
    order, then at shifts[1], ... ([rows, blocks, bytes] -> [rows, blocks, elements])."""
    rows, blocks, width = packed.shape
    runs = packed.contiguous().view(rows, blocks, width // run, run)
    out = torch.empty(rows, blocks, width // run, len(shifts), run, dtype=torch.uint8)
    for i, by in enumerate(shifts):  # (a scalar shift at a time: shifting by a tensor is slow)
        torch.bitwise_and(runs >> by, mask, out=out[:, :, :, i])
    return out.view(rows, blocks, -1)


def _by_output(words: torch.Tensor) -> torch.Tensor:
    """Each output's 32-bit words [rows, blocks, units, W] -> [groups, blocks, units, W * 64
    bytes]: word w of the group's 16 outputs side by side."""
    rows, blocks, units, w = words.shape
    g = rows // GROUP
    return words.view(g, GROUP, blocks, units, w).permute(0, 2, 3, 4, 1).contiguous() \
        .view(torch.uint8).view(g, blocks, units, 64 * w)


def _nibble_runs(q: torch.Tensor) -> torch.Tensor:
    """Quants [rows, blocks, inputs] (0..15) -> [groups, blocks, units, 256]: per unit 4 runs
    of 32 words, run u's word 2o + e holding in nibble s output o's element e of pair 4u + s.

    A run's 8 inputs 2s + e of one output, one byte each, are an int64: the bytes b_i | b_i+2
    << 4 (t) hold the nibble pairs of words (u, e); bytes 0, 4 of t are the word of e = 0
    and bytes 1, 5 that of e = 1."""
    rows, blocks, inputs = q.shape
    x = q.contiguous().view(torch.int64)
    t = x | (x >> 12)
    both = (t & 0xFF) | ((t >> 24) & 0xFF00) | ((t << 8) & 0xFF0000) | ((t >> 16) & 0xFF000000)
    return _by_output(both.to(torch.int32).view(rows, blocks, inputs // UNIT, 4))


def _high_planes(high: torch.Tensor, bits: int) -> torch.Tensor:
    """Quants' bits 4.. ([rows, blocks, inputs], each `bits` wide) -> [groups, blocks, units,
    64 * bits]: `bits` word vectors per unit, each of 16 / bits pairs, word 2o + e holding
    pair j's field at bit bits * j."""
    rows, blocks, inputs = high.shape
    per_word = 16 // bits
    # [row, block, unit, vector, j, e] -> [row, block, unit, vector, e, j]
    v = high.view(rows, blocks, inputs // UNIT, bits, per_word, 2).transpose(-1, -2)
    words = _pack_bits(v.contiguous(), bits)  # [..., vector, e, 2 bytes]
    words = words.view(rows, blocks, inputs // UNIT, bits, 4).view(torch.int32)
    return _by_output(words.view(rows, blocks, inputs // UNIT, bits))


def _pack_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Fields of `bits` bits (contiguous, along the last dimension) into bytes, little end
    first: the 8 / bits bytes of one output byte read as one integer, each field shifted
    down into place."""
    per_byte = 8 // bits
    x = v.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[per_byte])
    out = x.clone()
    for i in range(1, per_byte):
        out |= x >> (i * (8 - bits))
    return (out & 0xFF).to(torch.uint8).view(*v.shape[:-1], -1)
