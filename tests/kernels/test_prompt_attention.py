"""The prompt-attention kernel (csrc/prompt_attention.cpp), on AMX tiles and on AVX512-BF16
dot products, against causal attention in float64, with torch's own flash attention on the
same bf16 inputs as the yardstick.

Prompts of ragged lengths around the kernel's 16-query and 32-key blocks, packed in one
call between tokens that are not theirs (q/k/v views into a fused qkv, as in the model);
GQA; scores that grow along the prompt so that the running maximum must be raised (and
the output rescaled) in later blocks, and a large-magnitude case that the maximum's slack
must not overflow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_features import cpu_flags, cpu_has_amx_bf16  # tests/ (pytest prepends the rootdir)
from pagedllm.kernels import build
from pagedllm.attention import cpu_paged

ext = build.load()
HEADS, KV_HEADS, DIM = 9, 3, 64


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


def packed(lens: list[int], seed: int, gap: int = 3, scale_growth: float = 0.0):
    """q, k, v views into one [T, (H + 2 Hkv) D] tensor; prompt i's tokens start at
    starts[i], with `gap` foreign tokens before each. scale_growth > 0 makes a token's
    keys larger the later it comes (later blocks hold the largest scores)."""
    gen = torch.Generator().manual_seed(seed)
    starts, t = [], 0
    for n in lens:
        t += gap
        starts.append(t)
        t += n
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    if scale_growth:
        qkv[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM] *= 1 + scale_growth * torch.arange(t)[:, None] / t
    qkv = qkv.bfloat16()
    q = qkv[:, :HEADS * DIM].view(t, HEADS, DIM)
    k = qkv[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(t, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM:].view(t, KV_HEADS, DIM)
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


def check(lens, seed, scale=DIM ** -0.5, scale_growth=0.0):
    q, k, v, starts = packed(lens, seed, scale_growth=scale_growth)
    ours = run_kernel(q, k, v, starts, lens, scale)
    ref = attention(q, k, v, starts, lens, scale, torch.float64)
    torch_bf16 = attention(q, k, v, starts, lens, scale, torch.bfloat16)
    mine = torch.zeros(q.shape[0], dtype=torch.bool)
    for s, n in zip(starts, lens):
        mine[s:s + n] = True
    assert (ours[~mine] == 7).all(), "wrote outside its prompts"
    err = (ours[mine].double() - ref[mine]).abs().max().item()
    torch_err = (torch_bf16[mine].double() - ref[mine]).abs().max().item()
    # bf16 output: an ulp of the largest values is 2^-8 relative; torch's flash attention
    # on the same inputs is the yardstick.
    assert err <= max(1.5 * torch_err, 2 ** -8 * ref[mine].abs().max().item()), (err, torch_err)
    return err


@pytest.mark.parametrize("lens", [[1], [15], [16], [17], [31, 32, 33], [5, 64, 100],
                                  [257], [513, 2]])
def test_ragged_prompts_match_float64(lens):
    check(lens, seed=sum(lens))


def test_scores_growing_along_the_prompt_raise_the_maximum():
    """Keys scaled up 8x by the end of a 600-token prompt, and a large softmax scale:
    later chunks' scores exceed the running maximum by far more than its slack, so O and
    the sums are rescaled several times per query block."""
    check([600], seed=1, scale=1.0, scale_growth=7.0)


def test_large_scores_within_the_slack_do_not_overflow():
    check([300, 47], seed=2, scale=4.0)


def test_every_head_of_a_group_reads_its_own_kv_head():
    """Each KV head's values are a different constant: every query head must average the
    constant of its own group."""
    q, k, v, starts = packed([40], seed=3, gap=0)
    v = torch.stack([torch.full((40, DIM), float(h + 1)) for h in range(KV_HEADS)], 1).bfloat16()
    out = run_kernel(q, k, v, starts, [40], DIM ** -0.5)
    group = HEADS // KV_HEADS
    for h in range(HEADS):
        assert (out[:, h] == h // group + 1).all(), h


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (7, 40), (33, 256), (96, 1000)])
def test_prefix_attention_sees_every_key_and_returns_the_log_sum_exp(num_queries, num_keys):
    """Cascade attention's shared part: queries over a prefix that precedes them all."""
    gen = torch.Generator().manual_seed(num_keys)
    qkv = torch.randn(num_queries, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).bfloat16()
    q = qkv[:, :HEADS * DIM].view(num_queries, HEADS, DIM)  # a strided view, as in the model
    k, v = (torch.randn(num_keys, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
    scale = DIM ** -0.5
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = ext.attention_over_keys(out, q, k, v, scale, False)
    group = HEADS // KV_HEADS
    scores = torch.einsum("thd,khd->thk", q.double(),
                          k.double().repeat_interleave(group, 1)) * scale
    ref = torch.einsum("thk,khd->thd", scores.softmax(-1), v.double().repeat_interleave(group, 1))
    flash = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], scale=scale,
                                           enable_gqa=True)[0].transpose(0, 1)
    err, torch_err = ((x.double() - ref).abs().max().item() for x in (out, flash))
    assert err <= max(1.5 * torch_err, 2 ** -8 * ref.abs().max().item()), (err, torch_err)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=0, atol=1e-3)


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (1, 70), (20, 33), (100, 612)])
def test_a_chunk_over_its_cached_prefix_is_causal_from_its_offset(num_queries, num_keys):
    """Chunked prefill: the queries are the last positions of the keys."""
    gen = torch.Generator().manual_seed(num_keys + 1)
    q = torch.randn(num_queries, HEADS, DIM, generator=gen).bfloat16()
    k, v = (torch.randn(num_keys, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = ext.attention_over_keys(out, q, k, v, 0.125, True)
    group = HEADS // KV_HEADS
    scores = torch.einsum("thd,khd->thk", q.double(), k.double().repeat_interleave(group, 1)) * 0.125
    position = torch.arange(num_queries) + num_keys - num_queries
    scores = scores.masked_fill(torch.arange(num_keys)[None, None, :] > position[:, None, None],
                                float("-inf"))
    ref = torch.einsum("thk,khd->thd", scores.softmax(-1), v.double().repeat_interleave(group, 1))
    assert (out.double() - ref).abs().max().item() <= 2 ** -7 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=0, atol=1e-3)
    with pytest.raises(RuntimeError, match="last of the keys"):
        ext.attention_over_keys(torch.empty(num_keys + 1, HEADS, DIM, dtype=torch.bfloat16),
                                torch.zeros(num_keys + 1, HEADS, DIM, dtype=torch.bfloat16),
                                k, v, 0.125, True)


def test_the_engine_takes_it_for_bf16_head_dim_64_only():
    assert cpu_paged.prompt_kernel(torch.zeros(1, HEADS, 64, dtype=torch.bfloat16))
    assert not cpu_paged.prompt_kernel(torch.zeros(1, HEADS, 64))
    assert not cpu_paged.prompt_kernel(torch.zeros(1, HEADS, 128, dtype=torch.bfloat16))


def test_bad_arguments_are_refused():
    q, k, v, starts = packed([8], seed=4)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside q"):
        ext.prompt_attention(out, q, k, v, torch.tensor([q.shape[0] - 2]), torch.tensor([8]), 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.prompt_attention(out.float(), q.float(), k.float(), v.float(), torch.tensor(starts),
                             torch.tensor([8]), 0.1)
