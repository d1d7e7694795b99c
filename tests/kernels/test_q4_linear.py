"""GGUF Q4_1 weights kept quantized (layers/quantized.py, csrc/q4_linear.cpp): the kernel
computes x . w with w's exact values d * q + m (against a float64 reference), a row's result
does not depend on its batch, the packing keeps every quant where the kernel reads it, and
the real GGUF's parts are exactly the weights the dequantizer gives."""
from __future__ import annotations

import pytest
import torch

from cpu_features import cpu_flags
from pagedllm.kernels import build
from pagedllm.layers.quantized import can_pack_q4_1, is_q4_1, pack_q4_1

pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                                reason="the Q4_1 kernel needs a CPU with AVX512-BF16")


@pytest.fixture(scope="module")
def ext():
    ext = build.load()
    assert ext is not None, build.load_error  # a build failure fails the tests
    return ext


def random_q4_1(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    m = (-torch.rand(n, k // 32, generator=g) * 0.15).half()
    return q, d, m


def dequantized(q, d, m) -> torch.Tensor:
    return d.double().repeat_interleave(32, 1) * q.double() + m.double().repeat_interleave(32, 1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 64, 257])
@pytest.mark.parametrize("n,k", [(64, 32), (128, 96), (192, 64), (960, 576), (576, 1536)])
def test_matches_a_float64_product_with_the_exact_weights(ext, rows, n, k):
    q, d, m = random_q4_1(n, k, seed=rows + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = ext.q4_1_linear_bf16(x, pack_q4_1(q, d, m))
    ref = x.double() @ dequantized(q, d, m).T
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    # fp32 sums rounded once to bf16: within a bf16 rounding of the exact result (plus the
    # fp32 sums' error, far smaller, relative to the row's largest value)
    scale = ref.abs().amax(1, keepdim=True)
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + scale * 1e-5).all()


def test_a_rows_result_does_not_depend_on_its_batch(ext):
    """Rows alone (the one-row tiles), in small batches and in large ones (4-row tiles, 256-row
    chunks split between the threads): the same bits."""
    q, d, m = random_q4_1(192, 576)
    packed = pack_q4_1(q, d, m)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = ext.q4_1_linear_bf16(x, packed)
    alone = torch.cat([ext.q4_1_linear_bf16(x[i:i + 1], packed) for i in range(0, 300, 7)])
    assert torch.equal(alone, whole[::7])
    for size in (2, 3, 5, 64):
        assert torch.equal(ext.q4_1_linear_bf16(x[:size], packed), whole[:size])


def test_strided_input_is_taken_as_its_values(ext):
    q, d, m = random_q4_1(64, 64)
    packed = pack_q4_1(q, d, m)
    wide = torch.randn(5, 128).bfloat16()
    assert torch.equal(ext.q4_1_linear_bf16(wide[:, ::2], packed),
                       ext.q4_1_linear_bf16(wide[:, ::2].contiguous(), packed))


def test_each_quant_scale_and_minimum_lands_where_the_kernel_reads_it(ext):
    """One quant set at a time (all others 0, every m 0): only its output sees it, by its
    own d, at its own input."""
    n, k = 128, 64
    d = (torch.arange(n * k // 32).reshape(n, k // 32) % 7 + 1).half() / 8
    m = torch.zeros(n, k // 32, dtype=torch.float16)
    eye = torch.eye(k).bfloat16()
    for o, i in [(0, 0), (17, 33), (64, 5), (127, 63), (70, 31)]:
        q = torch.zeros(n, k, dtype=torch.uint8)
        q[o, i] = 9
        y = ext.q4_1_linear_bf16(eye, pack_q4_1(q, d, m))
        expected = torch.zeros(k, n)
        expected[i, o] = 9 * d[o, i // 32].float()
        assert torch.equal(y.float(), expected), (o, i)


def test_minimums_add_m_times_the_blocks_sum(ext):
    n, k = 64, 96
    q = torch.zeros(n, k, dtype=torch.uint8)
    d = torch.ones(n, k // 32, dtype=torch.float16)
    m = (torch.arange(n * 3).reshape(n, 3) % 5).half() - 2
    x = torch.zeros(1, k).bfloat16()
    x[0, 40:44] = 1.5                                    # inside block 1 only
    y = ext.q4_1_linear_bf16(x, pack_q4_1(q, d, m))
    assert torch.equal(y[0].float(), 6.0 * m[:, 1].float())


def test_bad_shapes_are_refused_with_clear_errors(ext):
    q, d, m = random_q4_1(64, 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_q4_1(q[:48], d[:48], m[:48])
    with pytest.raises(ValueError, match="scales"):
        pack_q4_1(q, d[:, :1], m)
    packed = pack_q4_1(q, d, m)
    with pytest.raises(RuntimeError, match="packed weight's K"):
        ext.q4_1_linear_bf16(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="pack_q4_1"):
        ext.q4_1_linear_bf16(torch.randn(2, 64).bfloat16(), packed.view(-1, 320))
    assert is_q4_1(packed) and not is_q4_1(None) and not is_q4_1(torch.empty(4, 4).bfloat16())
    assert can_pack_q4_1(960, 576) and not can_pack_q4_1(48, 576) and not can_pack_q4_1(64, 48)


def test_the_gguf_q4_1_parts_are_the_dequantized_weights(gguf_path):
    """ModelSource.q4_1_weights gives, in HF layout (q and k rows un-permuted like the
    dequantized weights), parts whose d * q + m are the dequantized weights exactly."""
    from pagedllm.loader import load_model_source
    source = load_model_source(str(gguf_path))
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.29.mlp.down_proj.weight"}
    parts = {name: p for name, p in source.q4_1_weights() if name in wanted}
    weights = {name: w for name, w in source.weights(torch.float32) if name in wanted}
    assert parts.keys() == wanted
    for name, (q, d, m) in parts.items():
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        assert torch.equal(dequantized(q, d, m).float(), weights[name]), name
