"""The fused C++ elementwise ops (csrc/elementwise.cpp) against the torch code they replace:
RMSNorm (+ residual), SiLU-and-mul, the rotary embedding and the sampler's argmax. In bf16
they round where torch rounds, so all but a rare last-bit difference match exactly."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import build, probes
from pagedllm.layers.rotary import RotaryEmbedding, rotate_half

ext = build.load()


@pytest.fixture(scope="module", autouse=True)
def kernels_build():
    assert ext is not None, build.load_error


def torch_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def assert_like_torch(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    else:  # one bf16 ulp at most, and almost never (two in the scalar loops of a build
        # with neither AVX-512 nor AVX2, whose sums run in another order; layers take torch's
        # ops there)
        ulps = 1 if probes.elementwise_vectorized() else 2
        torch.testing.assert_close(ours.float(), ref.float(), rtol=ulps * 2 ** -7, atol=1e-6)
        assert (ours == ref).float().mean() > 0.99


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    (out,) = ext.rms_norm(x, None, w, 1e-5)
    assert_like_torch(out, torch_rms_norm(x, w, 1e-5))
    out, new_res = ext.rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, x + res)
    assert_like_torch(out, torch_rms_norm(x + res, w, 1e-5))


def test_bf16_stores_round_denormals_infinities_and_nan_like_torch():
    """bf16 stores take the CPU's conversion unless a vector holds a NaN or a denormal;
    those take the exact rounding: denormal sums keep their bits, NaN stays NaN."""
    x = torch.tensor([1e-39, -3e-40, float("nan"), float("inf"), -float("inf"), 3e38, 1.0,
                      0.0] * 2 + [1.0] * 16).bfloat16()
    res = torch.tensor([2e-39, 1e-40, 1.0, 1.0, 1.0, 3e38, 1e-3, -0.0] * 2 + [0.5] * 16).bfloat16()
    _, new_res = ext.rms_norm(x[None], res[None], torch.ones(32).bfloat16(), 1e-5)
    ref = x + res
    finite = ~ref.isnan()
    assert torch.equal(new_res[0][finite].view(torch.int16), ref[finite].view(torch.int16))
    assert new_res[0][~finite].isnan().all()
    assert (new_res[0, :2] != 0).all()  # the denormal sums were not flushed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 257])
def test_silu_and_mul(dtype, rows):
    x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    gate, up = x.chunk(2, -1)
    assert_like_torch(ext.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype):
    rope = RotaryEmbedding(64, 4096, 10000.0)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, (9 + 3 + 3) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (11,), generator=gen)
    qk = qkv[:, :12 * 64].view(11, 12, 64)  # rows 15 * 64 apart, as in the model
    cos = rope.cos_cache[positions].unsqueeze(1).to(dtype)
    sin = rope.sin_cache[positions].unsqueeze(1).to(dtype)
    ref = qk * cos + rotate_half(qk) * sin
    v_before = qkv[:, 12 * 64:].clone()
    ext.rotary_embedding(positions, qk, rope.cos_cache, rope.sin_cache)
    assert_like_torch(qk, ref)
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="out of the rotary cache"):
        ext.rotary_embedding(torch.tensor([4096]), qk[:1], rope.cos_cache, rope.sin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_first_index_on_ties_and_nan_like_torch(dtype):
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[3, 10] = x[3, 500] = x[3].max() + 1  # a tie: the first index wins
    x[4, 40000] = x[4, 40001] = x[4].max() + 1  # a tie after the first vector's
    x[5, 7] = float("nan")
    x[6] = float("-inf")
    assert torch.equal(ext.argmax_rows(x), x.argmax(-1))
    assert torch.equal(ext.argmax_rows(x), x.float().argmax(-1))  # widening keeps the order
    for width in (1, 7, 16, 33):  # the vector loop's tail
        y = torch.randn(6, width, generator=torch.Generator().manual_seed(width)).to(dtype)
        y[1, -1] = y[1].max() + 1
        assert torch.equal(ext.argmax_rows(y), y.argmax(-1))
    with pytest.raises(RuntimeError, match="supports float32, bfloat16 and float16"):
        ext.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))


def test_pagedllm_cpu_kernels_0_turns_every_kernel_off():
    """PAGEDLLM_CPU_KERNELS=0 turns every C++ kernel off (torch's ops only)."""
    import subprocess
    import sys
    code = ("from pagedllm.kernels import build; from pagedllm.attention.dispatch import resolve_backend;"
            "import torch; print(build.load() is None, resolve_backend('auto', 'cpu', 16, torch.float32))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PAGEDLLM_CPU_KERNELS": "0"}, timeout=120)
    assert out.stdout.split() == ["True", "torch"], out.stderr


@pytest.mark.parametrize("vocab", [32, 1000, 49152 + 7])
def test_token_bitmask_masks_exactly_the_unset_bits_of_the_chosen_rows(vocab):
    """Grammar masks applied in place (sampler.apply_token_controls): -inf exactly where the
    unpacked mask is False, on the rows named, whole words allowed or refused and mixed
    words alike; other rows untouched."""
    from pagedllm.layers.sampler import unpack_token_masks
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    masks = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    masks[0, ::3] = -1  # all allowed
    masks[1, 1::3] = 0  # none allowed
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([4, 0, 2])
    ours = logits.clone()
    ext.apply_token_bitmask_(ours, masks, rows)
    allowed = unpack_token_masks(masks, vocab)
    ref = logits.clone()
    ref[rows] = torch.where(allowed, logits[rows], float("-inf"))
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])
    with pytest.raises(RuntimeError, match="out of range"):
        ext.apply_token_bitmask_(ours, masks, torch.tensor([0, 1, 5]))
