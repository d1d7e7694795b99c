"""The small-batch bf16 linear kernel (csrc/small_linear.cpp) against float64 products."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_features import cpu_has_amx_bf16  # tests/ (pytest prepends the rootdir)
from types import SimpleNamespace

from pagedllm.kernels import build, ops, probes
from pagedllm.layers.linear_methods import OneDNNLinearMethod

ext = build.load()
if ext is None or not ext.has_small_linear_bf16():
    # Only CPUs with AVX512-BF16 get the kernel (the engine then uses F.linear); CI's do.
    pytest.skip("no AVX512-BF16 on this CPU: the engine uses F.linear", allow_module_level=True)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(576, 576), (7, 33), (130, 1536), (3, 64), (49, 31)])
def test_matches_float64_like_torch(m, n, k):
    check_against_float64(ext.small_linear_bf16, m, n, k)


def check_against_float64(kernel, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    ref = x.double() @ w.double().T
    ours = kernel(x, w)
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
    # bf16 inputs multiply exactly; fp32 sums, then one rounding to bf16 (like torch's own)
    torch.testing.assert_close(ours.double(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)
    theirs = F.linear(x, w).double()
    assert (ours.double() - ref).abs().max() <= 2 * (theirs - ref).abs().max() + 1e-6


def test_rows_of_a_strided_input():
    x = torch.randn(3, 2, 96).bfloat16()[:, 1]  # rows 192 elements apart
    w = torch.randn(40, 96).bfloat16()
    torch.testing.assert_close(ext.small_linear_bf16(x, w), ext.small_linear_bf16(x.contiguous(), w))


def test_linear_layers_route_bf16_rows_by_count(monkeypatch):
    """Up to small_linear_rows() rows (16, or 4 on a CPU with AMX): the weight-streaming
    kernel; then up to 32 (K and N multiples of 32, with AMX): the AMX kernel; more:
    oneDNN / torch."""
    calls = []
    # without AMX the AMX kernel stays unavailable: no wrapper may make it look there
    names = ("small_linear_bf16",) + (("amx_linear_bf16",) if ext.amx_available() else ())
    for name in names:
        kernel = getattr(ext, name)
        monkeypatch.setattr(ops, name,
                            lambda x, w, kernel=kernel, name=name: calls.append((name, len(x)))
                            or kernel(x, w))

    def linear(x, w, b=None):  # a bf16 weight that is not packed for pagedllm's kernel
        return OneDNNLinearMethod().apply(SimpleNamespace(weight=w, packed_weight=None), x, b)

    w, b = torch.randn(64, 128).bfloat16(), torch.randn(64).bfloat16()
    small, amx = probes.small_linear_rows(), probes.amx_linear_rows()
    assert small == (probes.SMALL_LINEAR_MAX_ROWS_AMX if amx else probes.SMALL_LINEAR_MAX_ROWS)
    for rows in (1, small, small + 1) + ((amx, amx + 1) if amx else ()):
        x = torch.randn(rows, 128).bfloat16()
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=2e-2, atol=5e-2)
    linear(torch.randn(2, 128), w.float())  # fp32 stays with torch
    linear(torch.randn(small + 1, 80).bfloat16(), torch.randn(64, 80).bfloat16())  # K % 32
    expected = [("small_linear_bf16", 1), ("small_linear_bf16", small)]
    if ext.amx_available():
        expected += [("amx_linear_bf16", small + 1), ("amx_linear_bf16", amx)]
    assert calls == expected


amx_here = pytest.mark.skipif(not cpu_has_amx_bf16(), reason="this CPU has no AMX-BF16: oneDNN takes 5+ rows")


@amx_here
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(576, 576), (960, 576), (64, 1536), (3072, 576)])
def test_amx_linear_matches_float64_like_torch(m, n, k):
    assert ext.amx_available()  # on an AMX CPU the kernel must be there
    check_against_float64(ext.amx_linear_bf16, m, n, k)


@amx_here
def test_amx_linear_rows_of_a_strided_input_and_bad_shapes():
    x = torch.randn(20, 2, 64).bfloat16()[:, 1]  # rows 128 elements apart
    w = torch.randn(64, 64).bfloat16()
    assert torch.equal(ext.amx_linear_bf16(x, w), ext.amx_linear_bf16(x.contiguous(), w))
    with pytest.raises(RuntimeError, match="1 to 32 rows"):
        ext.amx_linear_bf16(torch.randn(33, 64).bfloat16(), w)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ext.amx_linear_bf16(torch.randn(8, 48).bfloat16(), torch.randn(64, 48).bfloat16())


def test_bad_shapes_are_clear_errors():
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        ext.small_linear_bf16(torch.randn(2, 8).bfloat16(), torch.randn(4, 9).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.small_linear_bf16(torch.randn(2, 8), torch.randn(4, 8))
