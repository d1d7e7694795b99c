"""GGUF weights kept quantized (layers/gguf_packing.py, csrc/gguf_linear.cpp), for every
type the kernel takes and each of its paths (AMX, AVX512-BF16, AVX2): the kernel computes x . w
with the exact weights gguf.quants.dequantize gives (against a float64 product) around every
tile and block edge, a row's result does not depend on its batch or the thread count, out=
writes only its columns, the packed form gives back the exact weights and stays within
1.10x the GGUF's bytes, and bad inputs are refused with clear errors."""
from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from cpu_features import cpu_flags, cpu_has_amx_int8
from pagedllm.kernels import build, ops
from pagedllm.layers.gguf_packing import (SUPPORTED_TYPES, can_pack, dequantize_packed_rows,
                                          gguf_nbytes, pack_gguf, packed_nbytes)

Q = GGMLQuantizationType
HAS_AVX512_BF16 = "avx512_bf16" in cpu_flags()
HAS_AVX2 = {"avx2", "fma", "f16c"} <= cpu_flags()

pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the GGUF kernel needs AVX2, FMA and F16C")

# Byte offsets of each type's fp16 fields in its GGUF block (d; Q4_1's m; the K-quants' dmin).
FP16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
               Q.Q6_K: [208]}
ISAS = [pytest.param("amx", marks=pytest.mark.skipif(
            not cpu_has_amx_int8(), reason="this CPU has no AMX-INT8")),
        pytest.param("avx512_bf16", marks=pytest.mark.skipif(
            not HAS_AVX512_BF16, reason="this CPU has no AVX512-BF16")), "avx2"]
TYPES = [pytest.param(t, id=t.name) for t in SUPPORTED_TYPES]


@pytest.fixture(scope="module")
def ext():
    ext = build.load()
    assert ext is not None, build.load_error  # a build failure fails the tests
    return ext


@pytest.fixture(params=ISAS)
def isa(request, ext):
    ops.force_gguf_linear_isa(request.param)
    assert ops.gguf_linear_isa() == request.param
    yield request.param
    ops.force_gguf_linear_isa("")


def random_gguf(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight's GGUF bytes [n, bytes per row]: random quants and integer scales (every
    byte pattern is a valid one), fp16 scales set to small finite values (negative
    minimums for Q4_1)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // block, type_size), dtype=torch.uint8, generator=g)
    for i, offset in enumerate(FP16_FIELDS[qtype]):
        value = torch.rand(n, k // block, generator=g) * 0.01 + 0.001
        if qtype == Q.Q4_1 and i == 1:
            value = -8 * value
        raw[:, :, offset:offset + 2] = value.half().view(torch.uint8).view(n, k // block, 2)
    return raw.reshape(n, -1)


def dequantized(qtype: GGMLQuantizationType, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), qtype)).reshape(n, k)


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bf16: bool) -> None:
    """y against the float64 product x w^T. The kernel's fp32 sums err by a few units of
    2^-24 of each scale unit's s (x . q') and c sum(x), terms up to ~200 |s| sum|x| where
    the weights are ~8 |s|: within 2^-12 of |x| . |w| (about 10x the worst case seen); a
    bf16 output adds its rounding, 2^-8 of the result. (The AVX2 path rounds x to 16-bit
    integers per scale unit: at most 2^-16 of the unit's largest |x| per input, well inside.)"""
    ref = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2**-12
    if bf16:
        bound += ref.abs() * 2**-8
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"worst error {(err / bound).max():.2f} of the bound"


def block_of(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [16, 48, 64, 80, 200])
@pytest.mark.parametrize("blocks", [1, 3])
def test_matches_a_float64_product_with_the_exact_weights(isa, qtype, n, blocks):
    """N around the 32-output padding and the 64-output panels, K one block or several,
    1-300 rows (one-row tiles, 4-row tiles and their leftovers)."""
    k = blocks * block_of(qtype)
    raw = random_gguf(qtype, n, k, seed=n + k)
    w, packed = dequantized(qtype, raw, n, k), pack_gguf(qtype, raw, n, k)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 16, 33, 64, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = ops.gguf_linear(x, packed, int(qtype), n)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        assert_close_to_exact(y, x, w, bf16=True)


@pytest.mark.parametrize("qtype", TYPES)
def test_several_super_blocks_and_panels(isa, qtype):
    n, k = 320, 1024
    raw = random_gguf(qtype, n, k, seed=3)
    x = torch.randn(9, k).bfloat16()
    y = ops.gguf_linear(x, pack_gguf(qtype, raw, n, k), int(qtype), n, fp32_out=True)
    assert_close_to_exact(y, x, dequantized(qtype, raw, n, k), bf16=False)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(isa, qtype):
    """Rows alone (one-row tiles), in batches of 2 to 300 (multi-row tiles and the rows left
    over, tiles that unpack the weight or read back the chunk's kept copy, 256-row chunks)
    and on one thread or two: the same bits."""
    n, k = 200, 2 * block_of(qtype)
    packed = pack_gguf(qtype, random_gguf(qtype, n, k), n, k)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = ops.gguf_linear(x, packed, int(qtype), n)
    alone = torch.cat([ops.gguf_linear(x[i:i + 1], packed, int(qtype), n)
                       for i in range(0, 300, 7)])
    assert torch.equal(alone, whole[::7])
    for size in (2, 4, 5, 6, 7, 11, 16, 31, 32, 64, 127, 128, 131):
        assert torch.equal(ops.gguf_linear(x[:size], packed, int(qtype), n), whole[:size])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(ops.gguf_linear(x, packed, int(qtype), n), whole)
            assert torch.equal(ops.gguf_linear(x[:1], packed, int(qtype), n), whole[:1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("qtype", TYPES)
def test_the_avx2_path_agrees_with_the_avx512_path(ext, qtype):
    n, k = 80, 2 * block_of(qtype)
    raw = random_gguf(qtype, n, k, seed=5)
    packed, w = pack_gguf(qtype, raw, n, k), dequantized(qtype, raw, n, k)
    x = torch.randn(6, k).bfloat16()
    try:
        ops.force_gguf_linear_isa("avx2")
        avx2 = ops.gguf_linear(x, packed, int(qtype), n, fp32_out=True)
        ops.force_gguf_linear_isa("avx512_bf16")
        avx512 = ops.gguf_linear(x, packed, int(qtype), n, fp32_out=True)
    finally:
        ops.force_gguf_linear_isa("")
    bound = (x.double().abs() @ w.double().abs().T) * 2**-11  # each within 2^-12
    assert ((avx2.double() - avx512.double()).abs() <= bound).all()


K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # on AMX CPUs: AMX-BF16 tiles


@pytest.mark.skipif(not cpu_has_amx_int8(), reason="this CPU has no AMX-INT8")
@pytest.mark.parametrize("qtype", [t for t in TYPES if t.values[0] not in K_QUANTS])
def test_the_amx_path_is_the_avx2_paths_sums_bit_for_bit_and_the_default(ext, qtype):
    """Q4_0, Q4_1 and Q8_0 on AMX: integer tiles from kAmxMinRows (11) rows, AVX512-VNNI
    below (one row alone, else tiles of up to 5 rows, 6-10 rows as two): all the AVX2 path's
    integer sums and epilogue, so every row count equals AVX2 bit for bit (and so a row
    alone equals it in any batch); where the CPU has AMX it is what runs unasked. (The
    K-quants take bf16 tiles: test_the_bf16_tiles_keep_special_values_to_their_rows.)"""
    assert ops.gguf_linear_isa() == "amx"
    n, k = 80, 2 * block_of(qtype)
    raw = random_gguf(qtype, n, k, seed=6)
    packed = pack_gguf(qtype, raw, n, k)
    # Scale units of 16 inputs (a Q6_K unit; the other types' 32 are two) scaled apart, some
    # all zero, some bf16 denormals or near them, some near the top of the range, one with an
    # inf: each path rounds x to 16-bit integers per unit with its own code (quantize_rows512
    # for the tiles and VNNI, quantize_rows256 for the AVX2 path), so this checks those too.
    unit_scales = torch.tensor([0.0, 2.0**-133, 2.0**-126, 2.0**-120, 1.0, 2.0**-20, 2.0**100])
    for rows in (1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 16, 17, 40):
        x = torch.randn(rows, k).bfloat16()
        units = torch.randint(len(unit_scales), (rows, k // 16), generator=torch.Generator().manual_seed(rows))
        spread = (torch.randn(rows, k) * unit_scales[units].repeat_interleave(16, 1)).bfloat16()
        spread[rows // 2, 16 * (rows % (k // 16)) + 3] = float("inf")
        for xs in (x, spread):
            tiles = ops.gguf_linear(xs, packed, int(qtype), n, fp32_out=True)
            try:
                ops.force_gguf_linear_isa("avx2")
                avx2 = ops.gguf_linear(xs, packed, int(qtype), n, fp32_out=True)
            finally:
                ops.force_gguf_linear_isa("")
            torch.testing.assert_close(tiles, avx2, rtol=0, atol=0, equal_nan=True, msg=str(rows))
        nan_rows = tiles.isnan().all(1)                 # the row holding the inf, only
        assert nan_rows[rows // 2] and int(nan_rows.sum()) == 1 and not tiles[~nan_rows].isnan().any()


@pytest.mark.skipif(not cpu_has_amx_int8(), reason="this CPU has no AMX-INT8")
@pytest.mark.parametrize("qtype", [t for t in TYPES if t.values[0] in K_QUANTS])
def test_the_bf16_tiles_keep_special_values_to_their_rows(ext, qtype):
    """The types on AMX-BF16 tiles (the K-quants), at the row counts of the one-row
    tiles, a partial tile, whole tiles and a padded last tile: scale units of x scaled apart
    (zeros, bf16 denormals, which the tiles read as zeros, 2^100) stay within the float64
    bound of the other paths, a row alone equals it in the batch, and an inf makes its own
    row's outputs not finite and no other row's."""
    assert ops.gguf_linear_isa() == "amx"
    n, k = 80, 2 * block_of(qtype)
    raw = random_gguf(qtype, n, k, seed=7)
    packed, w = pack_gguf(qtype, raw, n, k), dequantized(qtype, raw, n, k)
    unit_scales = torch.tensor([0.0, 2.0**-133, 2.0**-126, 1.0, 2.0**-20, 2.0**100])
    for rows in (1, 2, 5, 16, 17, 40):
        units = torch.randint(len(unit_scales), (rows, k // 16), generator=torch.Generator().manual_seed(rows))
        x = (torch.randn(rows, k) * unit_scales[units].repeat_interleave(16, 1)).bfloat16()
        y = ops.gguf_linear(x, packed, int(qtype), n, fp32_out=True)
        # the product of x with its denormals as zeros, give or take sums below 2^-126
        # (flushed to zero by the tiles: at most that times |s| < 1 a unit)
        normal = torch.where(x.float().abs() >= 2.0**-126, x.double(), 0.0)
        ref = normal @ w.double().T
        bound = (normal.abs() @ w.double().abs().T) * 2**-12 + k / 16 * 2.0**-126
        assert ((y.double() - ref).abs() <= bound).all(), rows
        alone = torch.cat([ops.gguf_linear(x[i:i + 1], packed, int(qtype), n, fp32_out=True)
                           for i in range(rows)])
        assert torch.equal(alone, y), rows
        x[rows // 2, 3] = float("inf")
        y = ops.gguf_linear(x, packed, int(qtype), n, fp32_out=True)
        finite = y.isfinite().all(1)
        assert not finite[rows // 2] and int((~finite).sum()) == 1, rows


@pytest.mark.skipif(cpu_has_amx_int8(), reason="this CPU has AMX-INT8")
def test_amx_tiles_are_refused_where_the_cpu_has_none(ext):
    with pytest.raises(RuntimeError, match="AMX tiles need a CPU with AMX-INT8"):
        ops.force_gguf_linear_isa("amx")
    assert ops.gguf_linear_isa() != "amx"


@pytest.mark.parametrize("qtype", [pytest.param(Q.Q4_K, id="Q4_K"), pytest.param(Q.Q8_0, id="Q8_0")])
@pytest.mark.parametrize("fp32_out", [False, True])
def test_out_writes_only_its_column_slice(isa, qtype, fp32_out):
    """A column slice of a wider output (row stride 300) and an input with row stride > K."""
    n, k = 200, block_of(qtype)
    packed = pack_gguf(qtype, random_gguf(qtype, n, k), n, k)
    wide_x = torch.randn(5, k + 64).bfloat16()
    x = wide_x[:, :k]
    dtype = torch.float32 if fp32_out else torch.bfloat16
    big = torch.full((5, 300), 7.0, dtype=dtype)
    y = ops.gguf_linear(x, packed, int(qtype), n, out=big[:, 50:250], fp32_out=fp32_out)
    assert y.data_ptr() == big[:, 50:].data_ptr() and y.shape == (5, n)
    assert torch.equal(big[:, 50:250], ops.gguf_linear(x.contiguous(), packed, int(qtype), n,
                                                       fp32_out=fp32_out))
    assert (big[:, :50] == 7).all() and (big[:, 250:] == 7).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_fp32_out_is_the_sums_the_bf16_output_rounds(isa, qtype):
    n, k = 48, block_of(qtype)
    raw = random_gguf(qtype, n, k, seed=7)
    packed = pack_gguf(qtype, raw, n, k)
    x = torch.randn(5, k).bfloat16()
    y32 = ops.gguf_linear(x, packed, int(qtype), n, fp32_out=True)
    assert y32.dtype == torch.float32
    assert torch.equal(y32.bfloat16(), ops.gguf_linear(x, packed, int(qtype), n))
    assert_close_to_exact(y32, x, dequantized(qtype, raw, n, k), bf16=False)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_rows_are_the_exact_gguf_weights(ext, qtype):
    n, k = 200, 2 * block_of(qtype)
    raw = random_gguf(qtype, n, k, seed=11)
    w = dequantized(qtype, raw, n, k)
    rows = torch.tensor([0, 1, 15, 16, 63, 64, 130, 199, 5])
    got = dequantize_packed_rows(pack_gguf(qtype, raw, n, k), qtype, n, k, rows)
    assert got.dtype == torch.float32 and torch.equal(got, w[rows])


@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_form_is_at_most_1_10x_the_gguf_bytes(ext, qtype):
    for n, k in [(1024, 3072), (3072, 1024), (151936, 1024), (64, 256)]:
        assert packed_nbytes(qtype, n, k) <= 1.10 * gguf_nbytes(qtype, n, k), (n, k)
    n, k = 64, block_of(qtype)
    assert pack_gguf(qtype, random_gguf(qtype, n, k), n, k).numel() == packed_nbytes(qtype, n, k)
    assert packed_nbytes(qtype, n, k) == ops.gguf_packed_nbytes(int(qtype), n, k)


def test_bad_inputs_are_refused_with_clear_errors(ext):
    raw = random_gguf(Q.Q4_K, 64, 256)
    with pytest.raises(ValueError, match=r"\[64, 200\].*multiple of 256"):
        pack_gguf(Q.Q4_K, raw, 64, 200)
    with pytest.raises(ValueError, match="not Q5_0"):
        pack_gguf(Q.Q5_0, raw, 64, 256)
    with pytest.raises(ValueError, match="raw must be uint8"):
        pack_gguf(Q.Q4_K, raw[:, :100], 64, 256)
    assert can_pack(Q.Q6_K, 512) and not can_pack(Q.Q6_K, 480) and not can_pack(Q.Q5_0, 512)
    packed = pack_gguf(Q.Q4_K, raw, 64, 256)
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.gguf_linear(x.float(), packed, int(Q.Q4_K), 64)
    with pytest.raises(RuntimeError, match="pack_gguf's uint8 tensor"):
        ops.gguf_linear(torch.randn(2, 512).bfloat16(), packed, int(Q.Q4_K), 64)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.gguf_linear(torch.randn(2, 224).bfloat16(), packed, int(Q.Q4_K), 64)
    with pytest.raises(RuntimeError, match="ggml type 6"):
        ops.gguf_linear(x, packed, int(Q.Q5_0), 64)
    with pytest.raises(RuntimeError, match="pack_gguf's uint8 tensor"):
        ops.gguf_linear(x, packed, int(Q.Q6_K), 64)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.gguf_linear(x, packed, int(Q.Q4_K), 64, out=torch.empty(2, 64))
    with pytest.raises(RuntimeError, match="outside 0..63"):
        dequantize_packed_rows(packed, Q.Q4_K, 64, 256, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="amx"):
        ops.force_gguf_linear_isa("sse")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 16, 17, 33, 64, 65, 100, 129, 300])
def test_the_cxx_packer_writes_the_reference_layout_byte_for_byte(ext, qtype, n):
    """gguf_pack.cpp (field by field) against the layout built with torch ops on whole
    tensors (tests/gguf_pack_reference.py): every panel size, padding and block count."""
    from gguf_pack_reference import reference_pack
    block = GGML_QUANT_SIZES[qtype][0]
    for k in (block, 3 * block):
        raw = random_gguf(qtype, n, k, seed=n + k)
        assert torch.equal(pack_gguf(qtype, raw, n, k), reference_pack(qtype, raw, n, k))
