"""The prompt-attention kernel (csrc/prompt_attention.cpp), on AMX tiles and on AVX512-BF16
dot products, against causal attention in float64, with torch's own flash attention on the
same bf16 inputs as the yardstick.

Every case runs at head_dim 64, 128 and 256 (SmolLM2's, Qwen3's and Gemma's). Prompts of
ragged lengths around the kernel's 16-query and 32-key blocks, packed in one call between
tokens that are not theirs (q/k/v views into a fused qkv, as in the model); GQA groups of
1 to 8; scores that grow along the prompt so that the running maximum must be raised (and
the output rescaled) in later blocks, and a large-magnitude case that the maximum's slack
must not overflow.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from cpu_features import cpu_flags, cpu_has_amx_bf16  # tests/ (pytest prepends the rootdir)
from pagedllm.kernels import build
from pagedllm.attention import cpu_paged

ext = build.load()


@dataclass(frozen=True)
class Shape:
    dim: int
    heads: int
    kv_heads: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.dim ** -0.5


# SmolLM2's 9 query heads over 3 KV heads of 64, Qwen3-0.6B's 16 over 8 of 128, and 8 over
# 2 of Gemma's 256.
SHAPES = [Shape(64, 9, 3), Shape(128, 16, 8), Shape(256, 8, 2)]


@pytest.fixture(scope="module", autouse=True, params=["amx", "avx512_bf16"])
def isa(request):
    """Every test runs on each path the CPU has: AMX tiles, and AVX512-BF16 dot products
    (on an AMX CPU with AMX turned off for the module). Where the CPU has the instructions
    the kernel must be there: fail, never skip. Only a CPU without them skips, and says so."""
    assert ext is not None, build.load_error
    if request.param == "amx" and not cpu_has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: the kernel's AMX path is not run here")
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: prompts take torch's flash attention")
    ext.allow_amx_attention(request.param == "amx")
    try:
        assert ext.prompt_attention_isa() == request.param
        yield request.param
    finally:
        ext.allow_amx_attention(True)


@pytest.fixture(params=SHAPES, ids=lambda s: f"d{s.dim}")
def shape(request) -> Shape:
    return request.param


def packed(shape: Shape, lens: list[int], seed: int, gap: int = 3, scale_growth: float = 0.0):
    """q, k, v views into one [T, (H + 2 Hkv) D] tensor; prompt i's tokens start at
    starts[i], with `gap` foreign tokens before each. scale_growth > 0 makes a token's
    keys larger the later it comes (later blocks hold the largest scores)."""
    gen = torch.Generator().manual_seed(seed)
    starts, t = [], 0
    for n in lens:
        t += gap
        starts.append(t)
        t += n
    h, hkv, d = shape.heads, shape.kv_heads, shape.dim
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen)
    if scale_growth:
        qkv[:, h * d:(h + hkv) * d] *= 1 + scale_growth * torch.arange(t)[:, None] / t
    qkv = qkv.bfloat16()
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
    return q, k, v, starts


def attention(q, k, v, starts, lens, scale, dtype):
    out = torch.zeros(q.shape, dtype=dtype)
    for s, n in zip(starts, lens):
        qq, kk, vv = (x[s:s + n].transpose(0, 1)[None].to(dtype) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


def run_kernel(q, k, v, starts, lens, scale):
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)  # foreign tokens must stay 7
    ext.prompt_attention(out, q, k, v, torch.tensor(starts), torch.tensor(lens), scale)
    return out


def check(shape: Shape, lens, seed, scale=None, scale_growth=0.0):
    scale = shape.scale if scale is None else scale
    q, k, v, starts = packed(shape, lens, seed, scale_growth=scale_growth)
    ours = run_kernel(q, k, v, starts, lens, scale)
    ref = attention(q, k, v, starts, lens, scale, torch.float64)
    torch_bf16 = attention(q, k, v, starts, lens, scale, torch.bfloat16)
    mine = torch.zeros(q.shape[0], dtype=torch.bool)
    for s, n in zip(starts, lens):
        mine[s:s + n] = True
    assert (ours[~mine] == 7).all(), "wrote outside its prompts"
    assert_close_to(ours[mine], ref[mine], torch_bf16[mine])


def assert_close_to(ours, ref, torch_bf16):
    """bf16 output: within an ulp of the largest values (bf16 keeps 8 significant bits, so
    2^-7 to 2^-8 of them, by where they sit in their binade); torch's flash attention on the
    same inputs is the yardstick."""
    err = (ours.double() - ref).abs().max().item()
    torch_err = (torch_bf16.double() - ref).abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
    assert err <= max(1.5 * torch_err, ulp), (err, torch_err, ulp)


def over_keys_reference(q, k, v, scale, causal):
    """Attention of q [T, H, D] over k, v [S, Hkv, D] in float64 (causal: the queries are
    the last T of the S positions), and each query's log-sum-exp of its scores."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("thd,khd->thk", q.double(),
                          k.double().repeat_interleave(group, 1)) * scale
    if causal:
        position = torch.arange(q.shape[0]) + k.shape[0] - q.shape[0]
        hidden = torch.arange(k.shape[0])[None, None, :] > position[:, None, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.einsum("thk,khd->thd", scores.softmax(-1), v.double().repeat_interleave(group, 1))
    return out, scores.logsumexp(-1)


@pytest.mark.parametrize("lens", [[1], [15], [16], [17], [31, 32, 33], [5, 64, 100],
                                  [257], [513, 2]])
def test_ragged_prompts_match_float64(shape, lens):
    check(shape, lens, seed=sum(lens))


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_every_gqa_group_matches_float64(dim, group):
    """Prompts of 1, 15, 16, 17, 33 and 200 tokens in one call, 2 KV heads."""
    check(Shape(dim, 2 * group, 2), [1, 15, 16, 17, 33, 200], seed=group)


def test_scores_growing_along_the_prompt_raise_the_maximum(shape):
    """Keys scaled up 8x by the end of a 600-token prompt, and a large softmax scale:
    later chunks' scores exceed the running maximum by far more than its slack, so O and
    the sums are rescaled several times per query block."""
    check(shape, [600], seed=1, scale=scores_as_at_64(shape, 1.0), scale_growth=7.0)


def test_large_scores_within_the_slack_do_not_overflow(shape):
    check(shape, [300, 47], seed=2, scale=scores_as_at_64(shape, 4.0))


def scores_as_at_64(shape: Shape, scale: float) -> float:
    """The softmax scale that gives random scores the spread they have at head_dim 64 with
    this scale (a dot product of random vectors grows with the square root of D)."""
    return scale * (64 / shape.dim) ** 0.5


def test_every_head_of_a_group_reads_its_own_kv_head(shape):
    """Each KV head's values are a different constant: every query head must average the
    constant of its own group."""
    q, k, v, starts = packed(shape, [40], seed=3, gap=0)
    v = torch.stack([torch.full((40, shape.dim), float(h + 1)) for h in range(shape.kv_heads)],
                    1).bfloat16()
    out = run_kernel(q, k, v, starts, [40], shape.scale)
    for h in range(shape.heads):
        assert (out[:, h] == h // shape.group + 1).all(), h


def test_every_dimension_reaches_its_own_output(shape):
    """Every key has the same V, a different random value in each dimension: each output
    dimension must be its own (the bf16 rounding of P aside), in every 16- and 64-wide
    slice of D."""
    q, k, _, starts = packed(shape, [50], seed=5, gap=0)
    values = torch.randn(shape.dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    v = values.expand(50, shape.kv_heads, -1)
    out = run_kernel(q, k, v, starts, [50], shape.scale)
    torch.testing.assert_close(out.float(), values.float().expand(out.shape), rtol=2 ** -7,
                               atol=0)


def over_keys_case(shape: Shape, num_queries: int, num_keys: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d = shape.heads, shape.kv_heads, shape.dim
    qkv = torch.randn(num_queries, (h + 2 * hkv) * d, generator=gen).bfloat16()
    q = qkv[:, :h * d].view(num_queries, h, d)  # a strided view, as in the model
    k, v = (torch.randn(num_keys, hkv, d, generator=gen).bfloat16() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (7, 40), (33, 256), (96, 1000)])
def test_prefix_attention_sees_every_key_and_returns_the_log_sum_exp(shape, num_queries,
                                                                     num_keys):
    """Cascade attention's shared part: queries over a prefix that precedes them all."""
    q, k, v = over_keys_case(shape, num_queries, num_keys, seed=num_keys)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = ext.attention_over_keys(out, q, k, v, shape.scale, False)
    ref, ref_lse = over_keys_reference(q, k, v, shape.scale, causal=False)
    flash = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], scale=shape.scale,
                                           enable_gqa=True)[0].transpose(0, 1)
    assert_close_to(out, ref, flash)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-3)


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (1, 70), (20, 33), (100, 612)])
def test_a_chunk_over_its_cached_prefix_is_causal_from_its_offset(shape, num_queries, num_keys):
    """Chunked prefill: the queries are the last positions of the keys."""
    q, k, v = over_keys_case(shape, num_queries, num_keys, seed=num_keys + 1)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = ext.attention_over_keys(out, q, k, v, 0.125, True)
    ref, ref_lse = over_keys_reference(q, k, v, 0.125, causal=True)
    assert (out.double() - ref).abs().max().item() <= 2 ** -7 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-3)
    with pytest.raises(RuntimeError, match="last of the keys"):
        q = torch.zeros(num_keys + 1, shape.heads, shape.dim, dtype=torch.bfloat16)
        ext.attention_over_keys(torch.empty_like(q), q, k, v, 0.125, True)


@pytest.mark.parametrize("causal", [False, True], ids=["prefix", "causal"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_over_keys_at_every_gqa_group(shape, group, causal):
    """Queries of 1, 15, 16, 17, 33 and 200 tokens over 37 more keys, 2 KV heads."""
    shape = Shape(shape.dim, 2 * group, 2)
    for n in [1, 15, 16, 17, 33, 200]:
        q, k, v = over_keys_case(shape, n, n + 37, seed=n)
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        lse = ext.attention_over_keys(out, q, k, v, shape.scale, causal)
        ref, ref_lse = over_keys_reference(q, k, v, shape.scale, causal)
        assert (out.double() - ref).abs().max().item() <= 2 ** -7 * max(1.0, ref.abs().max().item()), n
        torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-3)


def test_the_engine_takes_it_for_bf16_head_dims_64_128_256():
    for dim in (64, 128, 256):
        assert cpu_paged.prompt_kernel(torch.zeros(1, 8, dim, dtype=torch.bfloat16)), dim
    assert not cpu_paged.prompt_kernel(torch.zeros(1, 8, 64))
    for dim in (32, 96, 512):
        assert not cpu_paged.prompt_kernel(torch.zeros(1, 8, dim, dtype=torch.bfloat16)), dim


def test_bad_arguments_are_refused():
    q, k, v, starts = packed(SHAPES[0], [8], seed=4)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside q"):
        ext.prompt_attention(out, q, k, v, torch.tensor([q.shape[0] - 2]), torch.tensor([8]), 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.prompt_attention(out.float(), q.float(), k.float(), v.float(), torch.tensor(starts),
                             torch.tensor([8]), 0.1)
    q96, k96 = (torch.zeros(8, x.shape[1], 96, dtype=torch.bfloat16) for x in (q, k))
    with pytest.raises(RuntimeError, match="head_dim 64, 128 or 256"):
        ext.prompt_attention(torch.empty_like(q96), q96, k96, k96, torch.tensor([0]),
                             torch.tensor([8]), 0.1)
