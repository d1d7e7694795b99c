"""The packed bf16 linear kernel (csrc/packed_linear.cpp) against float64 products, and
which bf16 weights the engine packs for it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from types import SimpleNamespace

from pagedllm.kernels import build, ops, probes
from pagedllm.layers.linear_methods import (OneDNNLinearMethod, PackedBf16LinearMethod,
                                            TorchLinearMethod, select_linear_method)
from cpu_features import cpu_has_amx_bf16
from test_small_linear import check_against_float64  # tests/kernels (pytest prepends rootdir)

ext = build.load()
if ext is None or not ext.has_packed_linear_bf16():
    # Only CPUs with AVX512-BF16 get the kernel (the engine then uses oneDNN); CI's do.
    pytest.skip("no AVX512-BF16 on this CPU: the engine uses oneDNN", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True, params=["amx", "avx512_bf16"])
def isa(request):
    """Every test runs on each path the CPU has: AMX tiles (the packing is their weight
    operand as it stands), and AVX512-BF16 dot products (on an AMX CPU with AMX turned off
    for the module). Where the CPU has AMX-BF16 the AMX path must run: fail, never skip."""
    if request.param == "amx" and not cpu_has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: the kernel's AMX path is not run here")
    ext.allow_amx_linear(request.param == "amx")
    try:
        assert ext.packed_linear_uses_amx(64) == (request.param == "amx")
        assert not ext.packed_linear_uses_amx(34)  # K not whole tiles: the dot products
        yield request.param
    finally:
        ext.allow_amx_linear(True)


def loaded(w: torch.Tensor, fp32_out: bool = False):
    """The linear method chosen for a loaded weight, and a layer holding (a copy of) the
    weight as it processed it."""
    layer = SimpleNamespace(weight=w.clone(), packed_weight=None)
    method = select_linear_method(w, fp32_out)
    method.process_weights_after_loading(layer)
    return method, layer


def packed_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ext.packed_linear_bf16(x, ext.pack_linear_weight_bf16(w))


# Rows around the register tile (8; AMX: 16 and 32) and the work chunk (256); outputs
# around the panel of 3 groups of 16 (one, two or three groups in the last panel; AMX: 2,
# so an odd last group); K down to one pair, and K not a multiple of 32 (AMX: dot products).
@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 17, 31, 33, 64, 255, 257, 600])
@pytest.mark.parametrize("n,k", [(576, 576), (16, 2), (32, 34), (80, 1536), (960, 64), (48, 96)])
def test_matches_float64_like_torch(m, n, k):
    check_against_float64(packed_kernel, m, n, k)


def test_a_rows_result_does_not_depend_on_its_batch():
    """Each output is the same sums in the same order whatever the other rows are: a row
    computed alone, within 9 rows or within 300 gives the same bits."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 576, generator=gen).bfloat16()
    packed = ext.pack_linear_weight_bf16(torch.randn(960, 576, generator=gen).bfloat16())
    whole = ext.packed_linear_bf16(x, packed)
    for row in (0, 5, 8, 255, 299):
        assert torch.equal(ext.packed_linear_bf16(x[row:row + 1], packed), whole[row:row + 1])
    assert torch.equal(ext.packed_linear_bf16(x[3:12], packed), whole[3:12])


def test_rows_of_a_strided_input_and_empty_input():
    x = torch.randn(5, 2, 96).bfloat16()[:, 1]  # rows 192 elements apart
    packed = ext.pack_linear_weight_bf16(torch.randn(48, 96).bfloat16())
    assert torch.equal(ext.packed_linear_bf16(x, packed), ext.packed_linear_bf16(x.contiguous(), packed))
    assert ext.packed_linear_bf16(torch.empty(0, 96).bfloat16(), packed).shape == (0, 48)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(RuntimeError, match="N a multiple of 16 and K even"):
        ext.pack_linear_weight_bf16(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="N a multiple of 16 and K even"):
        ext.pack_linear_weight_bf16(torch.randn(48, 63).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        ext.pack_linear_weight_bf16(torch.randn(48, 64))
    packed = ext.pack_linear_weight_bf16(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="packed weight's K"):
        ext.packed_linear_bf16(torch.randn(2, 62).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="pack_linear_weight_bf16"):
        ext.packed_linear_bf16(torch.randn(2, 64).bfloat16(), torch.randn(48, 64).bfloat16())


def test_bf16_weights_are_packed_for_it_where_it_runs_and_take_it_at_every_row_count(monkeypatch, isa):
    """A bf16 weight with N % 16 == 0 and K even is packed for pagedllm's kernel (on AMX
    CPUs too), and its method sends every row count to it (bias added after); other shapes
    keep oneDNN's packing, fp32 weights none."""
    w, b = torch.randn(64, 128).bfloat16(), torch.randn(64).bfloat16()
    method, layer = loaded(w)
    odd_method, odd = loaded(torch.randn(40, 128).bfloat16())
    fp32_method, fp32 = loaded(w.float())
    assert isinstance(fp32_method, TorchLinearMethod) and fp32.packed_weight is None
    assert isinstance(odd_method, OneDNNLinearMethod) and odd.packed_weight is not None
    assert isinstance(method, PackedBf16LinearMethod)
    # the load log names the path it takes (K = 128: whole AMX tiles where AMX runs)
    assert ("AMX tiles" in method.kernel) == (isa == "amx")
    packed = layer.packed_weight
    calls = []
    kernel = ext.packed_linear_bf16
    monkeypatch.setattr(ops, "packed_linear_bf16",
                        lambda x, p, fp32_out=False: calls.append(len(x)) or kernel(x, p, fp32_out))
    for rows in (1, probes.small_linear_rows(), 17, 64, 300):
        x = torch.randn(rows, 128).bfloat16()
        ours = method.apply(layer, x, b)
        assert torch.equal(ours, kernel(x, packed) + b)
        torch.testing.assert_close(ours, F.linear(x, w, b), rtol=2e-2, atol=5e-2)
    assert calls == [1, probes.small_linear_rows(), 17, 64, 300]
    # fp32_out (logits): the same sums, unrounded
    x = torch.randn(9, 128).bfloat16()
    head_method, head = loaded(w, fp32_out=True)
    wide = head_method.apply(head, x)
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), kernel(x, packed))
    torch.testing.assert_close(wide, x.double().matmul(w.double().T).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 17, 33, 256, 300])
@pytest.mark.parametrize("i,k", [(1536, 576), (16, 2), (48, 34), (32, 1536), (8, 64)])
def test_gate_up_silu_is_the_linear_then_silu_and_mul_bit_for_bit(m, i, k):
    """The fused pass rounds like the two ops it replaces; gate and up of 8 features (one
    group of 16 outputs in all) take the two ops themselves."""
    gen = torch.Generator().manual_seed(m * 100 + i + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = ext.pack_linear_weight_bf16(torch.randn(2 * i, k, generator=gen).bfloat16() / k ** 0.5)
    fused = ext.packed_gate_up_silu_bf16(x, packed)
    assert fused.shape == (m, i)
    assert torch.equal(fused, ext.silu_and_mul(ext.packed_linear_bf16(x, packed)))


def test_the_mlp_takes_the_fused_pass_where_its_weight_is_packed_for_it(monkeypatch):
    from pagedllm.models.config import ModelConfig
    from pagedllm.models.llama import MLP
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    mlp = MLP(config).bfloat16()
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(9, 64).bfloat16()
    unpacked = mlp.forward(x)
    for m in (mlp.gate_up_proj, mlp.down_proj):
        m.process_weights_after_loading()
    calls = []
    kernel = ext.packed_gate_up_silu_bf16
    monkeypatch.setattr(ops, "packed_gate_up_silu_bf16",
                        lambda x, p: calls.append(len(x)) or kernel(x, p))
    packed = mlp.forward(x)
    fused_here = isinstance(mlp.gate_up_proj.linear_method, PackedBf16LinearMethod)
    assert calls == ([9] if fused_here else [])
    torch.testing.assert_close(packed, unpacked, rtol=2e-2, atol=2e-2)
    # fp32 weights keep torch's linear and SiLU-and-mul: no fused pass
    mlp = MLP(config).float()
    for m in (mlp.gate_up_proj, mlp.down_proj):
        m.weight.data.normal_(0, 0.1)
        m.process_weights_after_loading()
    mlp.forward(x.float())
    assert calls == ([9] if fused_here else [])


def test_a_packed_layer_holds_its_weight_once_and_still_answers_every_input():
    """After packing, the plain weight is an empty tensor; the packing gives back the exact
    weight and embedding rows, and inputs the kernel does not take directly (3-D, strided)
    are computed from it as their 2-D rows would be."""
    w = torch.randn(96, 64).bfloat16()
    method, layer = loaded(w)
    assert isinstance(method, PackedBf16LinearMethod)
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.bfloat16
    assert torch.equal(method.weight(layer), w)
    ids = torch.tensor([[0, 17, 95], [16, 15, 3]])
    assert torch.equal(method.embedding(layer, ids), F.embedding(ids, w))
    x = torch.randn(2, 5, 64).bfloat16()
    assert torch.equal(method.apply(layer, x), method.apply(layer, x.reshape(10, 64)).view(2, 5, 96))
    strided = torch.randn(7, 2, 64).bfloat16()[:, 1]
    assert torch.equal(method.apply(layer, strided), method.apply(layer, strided.contiguous()))
    with pytest.raises(RuntimeError, match="dtype"):  # as F.linear: no silent cast
        method.apply(layer, x.float())


def test_onednn_keeps_the_plain_weight_only_where_our_small_row_kernels_read_it(monkeypatch):
    """A shape the packed kernel does not take goes to oneDNN: with AVX512-BF16 the
    weight-streaming kernel reads the plain weight for few rows, so it stays (two forms);
    without, oneDNN's packing is the only form and the plain weight is rebuilt from it."""
    w, x = torch.randn(40, 128).bfloat16(), torch.randn(70, 128).bfloat16()
    method, layer = loaded(w)
    assert isinstance(method, OneDNNLinearMethod) and layer.weight.numel() == w.numel()
    expected = method.apply(layer, x)
    monkeypatch.setattr(probes, "has_avx512_bf16", lambda: False)
    method, layer = loaded(w)
    assert layer.weight.numel() == 0 and torch.equal(method.weight(layer), w)
    assert torch.equal(method.apply(layer, x), expected)
    assert torch.equal(method.apply(layer, x.view(7, 10, 128)), expected.view(7, 10, 40))
