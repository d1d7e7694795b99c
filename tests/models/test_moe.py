"""Mixture-of-experts: the FusedMoE layer against a per-token float64 reference, its
grouping of tokens by expert, its weight loaders and tensor-parallel split; then Qwen3-MoE,
Qwen2-MoE and Mixtral as tiny random models built with transformers' own classes, loaded
from an HF directory and from a GGUF: fp32 logits within 1e-4 of HF's, greedy replies equal
to HF's under every engine setting, bf16 replies close to HF's bf16 by vLLM's rule, and
tensor parallelism."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from family_harness import (Family, SETTING_CASES, assert_beam_search_equals_hf, assert_bf16_close,
                            assert_int8_kv_close,
                            assert_greedy_matches_hf, assert_logits_match_hf, greedy,
                            max_logit_error, models_fixture, prompt_ids)
from pagedllm import LLM
from pagedllm.distributed import set_tp
from pagedllm.kernels import probes
from pagedllm.layers.linear_methods import unpack_bf16
from pagedllm.layers.moe import FusedMoE, select_experts

E, H, I = 8, 64, 48  # experts, hidden size, each expert's intermediate size


def random_experts(seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(E, *shape, generator=gen) * scale
            for name, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}


def load_per_expert(layer: FusedMoE, experts: dict[str, torch.Tensor]) -> None:
    """As an HF checkpoint holds them: one [rows, cols] tensor per expert and projection."""
    for e in range(E):
        for shard, tensor in experts.items():
            param = layer.w2 if shard == "down" else layer.w13
            param.weight_loader(param, tensor[e].to(param.dtype), e, shard)


def build(experts: dict[str, torch.Tensor], top_k: int = 2, renormalize: bool = True,
          dtype: torch.dtype = torch.float32, weights_in_fp32: bool = False) -> FusedMoE:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = FusedMoE(E, top_k, H, I, renormalize, weights_in_fp32)
    finally:
        torch.set_default_dtype(default)
    load_per_expert(layer, experts)
    layer.process_weights_after_loading()
    return layer


def per_token_reference(x: torch.Tensor, logits: torch.Tensor,
                        experts: dict[str, torch.Tensor], top_k: int,
                        renormalize: bool) -> torch.Tensor:
    """Each token through its top-k experts one by one, in float64."""
    gate, up, down = (experts[n].double() for n in ("gate", "up", "down"))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, (row, row_logits) in enumerate(zip(x.double(), logits.double())):
        weights, ids = torch.softmax(row_logits, -1).topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            h = F.silu(gate[e] @ row) * (up[e] @ row)
            out[t] += w * (down[e] @ h)
    return out


def inputs(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=gen), torch.randn(tokens, E, generator=gen) * 2


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("top_k,renormalize", [(2, True), (2, False), (1, False), (3, True)])
def test_fp32_layer_matches_per_token_float64_reference(tokens, top_k, renormalize):
    experts = random_experts(tokens + top_k)
    x, logits = inputs(tokens, tokens)
    layer = build(experts, top_k, renormalize)
    ours = layer(x, logits)
    assert ours.dtype == torch.float32
    ref = per_token_reference(x, logits, experts, top_k, renormalize)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 16, 40])  # decode-sized (streaming kernel) and more
@pytest.mark.parametrize("weights_in_fp32", [False, True])
def test_bf16_layer_matches_per_token_float64_reference(tokens, weights_in_fp32):
    experts = {n: t.bfloat16().float() for n, t in random_experts(7).items()}
    x, logits = inputs(tokens + 100, tokens)
    x = x.bfloat16()
    layer = build(experts, dtype=torch.bfloat16, weights_in_fp32=weights_in_fp32)
    ours = layer(x, logits)
    assert ours.dtype == torch.bfloat16
    ref = per_token_reference(x, logits, experts, 2, True)
    # bf16 products of bf16 inputs are exact; the roundings are of the gate/up outputs,
    # the SiLU product, the down output and the weighted sum: a few bf16 ulps
    torch.testing.assert_close(ours.double(), ref, rtol=3e-2, atol=3e-2)


def test_bf16_experts_take_the_packed_kernel_or_the_streaming_one_for_few_rows(monkeypatch):
    """Where dense linears take pagedllm's packed kernel, bf16 experts are packed for it too
    (every weight held once, in the packed form: AMX CPUs too); elsewhere few rows take the
    weight-streaming kernel on the plain weight."""
    if not probes.has_avx512_bf16():
        pytest.skip("no AVX512-BF16 here: bf16 experts take F.linear")
    from pagedllm.kernels import ops
    calls: dict[str, list[int]] = {"packed": [], "streaming": []}
    for name, kind in (("packed_gate_up_silu_bf16", "packed"), ("packed_linear_bf16", "packed"),
                       ("small_linear_bf16", "streaming")):
        kernel = getattr(ops, name)
        monkeypatch.setattr(ops, name,
                            lambda x, w, k=kernel, c=calls[kind]: c.append(len(x)) or k(x, w))
    experts = random_experts(3)
    layer = build(experts, dtype=torch.bfloat16)
    layer.use_kernel = False  # (the C++ path makes the same choice: equal results below)
    x, logits = inputs(4, 3)
    layer(x.bfloat16(), logits)
    packs = probes.has_packed_linear()
    assert layer.packed == packs
    used, unused = ("packed", "streaming") if packs else ("streaming", "packed")
    assert calls[used] and all(rows <= 3 for rows in calls[used]) and not calls[unused]
    if packs:  # the packing holds the weights' exact values, in the parameters' own storage
        layer.process_weights_after_loading()  # again: packs nothing twice
        assert layer.w13.shape == (E, 2 * I // 16, H // 2, 16, 2)
        gate_up = torch.cat([experts["gate"], experts["up"]], 1).bfloat16()
        assert torch.equal(unpack_bf16(layer.w13), gate_up)
        assert torch.equal(unpack_bf16(layer.w2), experts["down"].bfloat16())


@pytest.mark.parametrize("weights_in_fp32", [False, True])
def test_bf16_experts_give_a_token_the_same_output_in_any_batch(weights_in_fp32):
    """A token's output does not depend on the other tokens of its step (which experts they
    share with it, how many rows each expert runs): alone and in batches of 1 to 40, bit for
    bit, where the experts take the packed kernel."""
    if not probes.has_packed_linear():
        pytest.skip("bf16 experts are not packed on this CPU")
    layer = build(random_experts(9), 3, dtype=torch.bfloat16, weights_in_fp32=weights_in_fp32)
    x, logits = inputs(10, 40)
    x = x.bfloat16()
    alone = torch.cat([layer(x[t:t + 1], logits[t:t + 1]) for t in range(40)])
    for rows in (2, 5, 17, 40):
        assert torch.equal(layer(x[:rows], logits[:rows]), alone[:rows])


def _kernel_and_loop(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output through moe_experts (one C++ call) and through the loop here."""
    layer.use_kernel = True
    fused = layer(x, logits)
    assert layer._described is not None, "bf16 rows on the CPU take the C++ path"
    layer.use_kernel = False
    return fused, layer(x, logits)


@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
@pytest.mark.parametrize("top_k,weights_in_fp32", [(2, False), (2, True), (3, False), (1, True)])
def test_bf16_experts_in_one_call_equal_the_loop_bit_for_bit(tokens, top_k, weights_in_fp32):
    if not probes.available():
        pytest.skip(f"C++ kernels unavailable: {probes.unavailable_reason()}")
    layer = build(random_experts(5), top_k, dtype=torch.bfloat16, weights_in_fp32=weights_in_fp32)
    x, logits = inputs(tokens + 200, tokens)
    fused, loop = _kernel_and_loop(layer, x.bfloat16(), logits)
    assert torch.equal(fused, loop)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_gguf_experts_in_one_call_equal_the_loop_bit_for_bit(qtype, tokens):
    """Experts kept quantized (quantization="gguf"): gate and up of one type, down of another
    (as Q4_K_M's Q6_K down projections)."""
    if not probes.available():
        pytest.skip(f"C++ kernels unavailable: {probes.unavailable_reason()}")
    from gguf import GGMLQuantizationType as T
    from gguf_from_hf import random_blocks
    from pagedllm.layers.quantized import GGUFWeight
    hidden = inter = 256  # a K-quant block
    rng = np.random.default_rng(0)
    layer = FusedMoE(E, 2, hidden, inter, renormalize=True)
    gate_type = T[qtype]
    for e in range(E):
        for shard, qt, rows, cols in (("gate", gate_type, inter, hidden), ("up", gate_type, inter, hidden),
                                      ("down", T.Q6_K, hidden, inter)):
            blocks = torch.from_numpy(random_blocks(qt, rows, cols, 0.05, rng))
            assert layer.take_gguf(GGUFWeight(qt, blocks, cols), e, shard)
    assert layer.finish_gguf()
    layer.process_weights_after_loading()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    logits = torch.randn(tokens, E, generator=gen)
    fused, loop = _kernel_and_loop(layer, x, logits)
    assert torch.equal(fused, loop)


def test_decode_read_bytes_count_a_tokens_experts_or_all_of_them():
    """A decode token reads top_k of E experts' packed bytes; the bench's roofline takes the
    weights with all experts (as llama-bench's file size) and scales them to a token's share
    itself, so it must get them all (it got the share, and scaled it again: a Qwen3-30B-A3B
    Q4_K_M file read 13% of a bound 8x too fast)."""
    if not probes.available():
        pytest.skip(f"C++ kernels unavailable: {probes.unavailable_reason()}")
    from gguf import GGMLQuantizationType as T
    from gguf_from_hf import random_blocks
    from pagedllm.layers.quantized import GGUFWeight
    from pagedllm.loader.model_loader import decode_read_bytes
    rng = np.random.default_rng(0)
    layer = FusedMoE(E, 2, 256, 256, renormalize=True)
    for e in range(E):
        for shard in ("gate", "up", "down"):
            blocks = torch.from_numpy(random_blocks(T.Q4_K, 256, 256, 0.05, rng))
            assert layer.take_gguf(GGUFWeight(T.Q4_K, blocks, 256), e, shard)
    assert layer.finish_gguf()
    every = sum(p.packed.nbytes for w13, w2 in layer.gguf_experts for p in w13 + w2)
    assert every >= 3 * 256 * 256 // 256 * 144 * E      # 144 bytes a Q4_K block of 256
    assert decode_read_bytes(layer, every_expert=True) == every
    assert decode_read_bytes(layer) == every * 2 // E


def count_expert_calls(layer: FusedMoE, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    expert = layer._expert
    monkeypatch.setattr(layer, "_expert", lambda e, x: calls.append(e) or expert(e, x))
    return calls


def test_each_expert_is_computed_once_per_forward_however_many_tokens_route_to_it(monkeypatch):
    experts = random_experts(11)
    layer = build(experts)
    calls = count_expert_calls(layer, monkeypatch)
    x, _ = inputs(12, 16)
    logits = torch.full((16, E), -4.0)
    logits[:, 0] = 5.0  # every token's first choice: expert 0
    logits[torch.arange(16), 1 + torch.arange(16) % 3] = 3.0  # second: experts 1, 2 or 3
    ours = layer(x, logits)
    assert sorted(calls) == [0, 1, 2, 3]
    torch.testing.assert_close(ours.double(), per_token_reference(x, logits, experts, 2, True),
                               rtol=1e-5, atol=1e-5)


def test_experts_no_token_routes_to_are_not_computed(monkeypatch):
    layer = build(random_experts(13))
    calls = count_expert_calls(layer, monkeypatch)
    x, logits = inputs(14, 1)
    layer(x, logits)
    assert sorted(calls) == sorted(select_experts(logits, 2, True)[1][0].tolist())


def test_routing_ties_pick_hf_transformers_experts():
    """Equal probabilities: torch.topk on the same fp32 softmax picks what HF picks."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0, 0.0, 1.0]])
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    hf_weights, hf_ids = torch.topk(probs, 2, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))


def test_stacked_and_fused_checkpoint_tensors_load_like_per_expert_ones():
    """GGUF's stacked [E, rows, cols] experts and transformers 5's fused gate_up tensor fill
    the same parameters as one tensor per expert and projection."""
    experts = random_experts(5)
    per_expert = build(experts)
    stacked = FusedMoE(E, 2, H, I, True)
    for shard, tensor in experts.items():
        param = stacked.w2 if shard == "down" else stacked.w13
        param.weight_loader(param, tensor, None, shard)
    fused = FusedMoE(E, 2, H, I, True)
    fused.w13.weight_loader(fused.w13, torch.cat([experts["gate"], experts["up"]], 1), None,
                            "gate_up")
    fused.w2.weight_loader(fused.w2, experts["down"], None, "down")
    for layer in (stacked, fused):
        assert torch.equal(layer.w13, per_expert.w13) and torch.equal(layer.w2, per_expert.w2)


def test_loader_rejects_tensors_of_the_wrong_shape():
    layer = FusedMoE(E, 2, H, I, True)
    with pytest.raises(ValueError, match="does not fit"):
        layer.w13.weight_loader(layer.w13, torch.zeros(I, H), None, "gate")  # one for all
    with pytest.raises(ValueError, match="does not fit"):
        layer.w2.weight_loader(layer.w2, torch.zeros(H, I + 1), 0, "down")
    with pytest.raises(ValueError, match="does not belong"):
        layer.w2.weight_loader(layer.w2, torch.zeros(I, H), 0, "gate")


def test_tensor_parallel_ranks_split_each_experts_intermediate_dimension():
    """Two ranks' layers hold halves of every expert's gate/up rows and down columns; their
    partial outputs sum to the whole expert's."""
    experts = random_experts(17)
    full = build(experts)
    ranks = []
    try:
        for rank in range(2):
            set_tp(rank, 2)
            ranks.append(build(experts))
    finally:
        set_tp(0, 1)
    half = I // 2
    for r, layer in enumerate(ranks):
        assert layer.w13.shape == (E, 2 * half, H) and layer.w2.shape == (E, H, half)
        torch.testing.assert_close(layer.w13[:, :half], experts["gate"][:, r * half:(r + 1) * half])
        torch.testing.assert_close(layer.w13[:, half:], experts["up"][:, r * half:(r + 1) * half])
        torch.testing.assert_close(layer.w2, experts["down"][:, :, r * half:(r + 1) * half])
    x, _ = inputs(18, 6)
    for e in range(E):
        torch.testing.assert_close(ranks[0]._expert(e, x) + ranks[1]._expert(e, x),
                                   full._expert(e, x), rtol=1e-5, atol=1e-6)


def test_dense_forward_for_cuda_graphs_equals_grouped_forward():
    """CUDA runs every expert on every row (no host sync inside a graph); the sum equals
    the grouped one's."""
    layer = build(random_experts(19))
    x, logits = inputs(20, 9)
    # (the matmuls see other row counts: fp32 sums in another order)
    torch.testing.assert_close(layer.forward_dense(x, logits), layer.forward_grouped(x, logits),
                               rtol=1e-5, atol=1e-5)


# ---- model families ------------------------------------------------------------------------

def _decisive_routing(model: torch.nn.Module) -> None:
    """Routers away from HF's init (std 0.02): routing far from ties, so that fp32
    rounding does not flip an expert choice."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


MOE_SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=512)
FAMILIES = {f.name: f for f in [
    # 8 experts, the top-2 weights renormalised
    Family("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen3moe",
           dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, tie_word_embeddings=False),
           init=_decisive_routing, sizes=MOE_SIZES),
    # q/k/v biases, a shared expert behind a sigmoid gate, top-2 weights not renormalised
    Family("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "qwen2moe",
           dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, tie_word_embeddings=False),
           init=_decisive_routing, sizes=MOE_SIZES),
    # top-2 of 8 renormalised; GGUF: arch "llama" with an expert count (Q/K rows permuted)
    Family("mixtral", "MixtralForCausalLM", "MixtralConfig", "llama",
           dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
           init=_decisive_routing, sizes={**MOE_SIZES, "intermediate_size": 32}),
]}


models = models_fixture(FAMILIES, "moe")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(models, family, fmt):
    assert_logits_match_hf(models(family), fmt)


@pytest.mark.parametrize("setting", SETTING_CASES)
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf(models, family, fmt, setting):
    assert_greedy_matches_hf(models(family), fmt, setting)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int8_kv_cache_close_to_hf(models, family):
    """kv_cache_dtype="int8" under fp32 activations: vLLM's closeness rule against HF."""
    built, prompts, reference = models(family)
    assert_int8_kv_close(built, "hf", prompts, reference)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_close_to_hf_bf16(models, family):
    built, prompts, _ = models(family)
    assert_bf16_close(built, "hf", prompts)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_fast_paths_equal_the_op_by_op_forward(models, family):
    """bf16 with the C++ kernels (the experts' weight-streaming linears, the one-call decode
    stack) gives the tokens the op-by-op forward (enforce_eager) gives."""
    built, prompts, _ = models(family)
    outs = []
    for eager in (False, True):
        llm = LLM(str(built.hf_dir), dtype="bfloat16", kv_cache_memory_bytes=16 * 2**20,
                  enforce_eager=eager)
        outs.append([o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_take_the_one_call_decode_stack_with_the_per_op_results(models, family,
                                                                        monkeypatch):
    """The decode stack routes as FusedMoE does (torch's fp32 softmax and top-k, the weights
    renormalised or not, rounded to bf16 or kept in fp32) and runs moe_experts and the
    shared expert: every decode step takes it, with the per-op forward's tokens and
    logprobs bit for bit."""
    from test_bf16 import assert_stack_equals_per_op  # tests/models (pytest's rootdir path)
    built, prompts, _ = models(family)
    assert_stack_equals_per_op(str(built.hf_dir), prompts, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_beam_search_equals_hf(models, family):
    built, prompts, _ = models(family)
    assert_beam_search_equals_hf(built, prompts[:4])


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt", [("qwen2-moe", "hf"), ("mixtral", "gguf")])
def test_tensor_parallel_2_greedy_matches_hf(models, family, fmt):
    """Two ranks split every expert's (and the shared expert's) intermediate dimension;
    routers are replicated."""
    built, prompts, reference = models(family)
    with LLM(built.path(fmt), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
             max_model_len=512, tensor_parallel_size=2, check_invariants=True) as llm:
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_gguf_of_llama_arch_with_experts_is_mixtral(models):
    from pagedllm.loader import load_model_source
    built, _, _ = models("mixtral")
    gguf, hf = (load_model_source(built.path(fmt)).config for fmt in ("gguf", "hf"))
    assert gguf.architecture == hf.architecture == "mixtral"
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "shared_expert_intermediate_size", "mlp_only_layers"):
        assert getattr(gguf, field) == getattr(hf, field), field


# config.json as real transformers 4.x checkpoints on the Hub write them (trimmed)
HF4_CONFIGS = {
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rope_theta=1000000.0, head_dim=128, intermediate_size=6144),
    "Qwen2MoeForCausalLM": dict(
        model_type="qwen2_moe", num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1000000.0, intermediate_size=5632),
    "MixtralForCausalLM": dict(
        model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
        rope_theta=1000000.0, intermediate_size=14336),
}


@pytest.mark.parametrize("architecture", list(HF4_CONFIGS))
def test_transformers_4_config_keys(architecture):
    from pagedllm.loader.hf_loader import config_from_hf
    hf = dict(architectures=[architecture], vocab_size=1000, hidden_size=2048,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
              rms_norm_eps=1e-6, **HF4_CONFIGS[architecture])
    config = config_from_hf(hf, "hub")
    assert config.rope_theta == 1e6
    assert config.num_experts == hf.get("num_experts", hf.get("num_local_experts"))
    assert config.num_experts_per_tok == hf["num_experts_per_tok"]
    assert config.moe_intermediate_size == hf.get("moe_intermediate_size",
                                                  hf["intermediate_size"])
    assert config.norm_topk_prob == hf.get("norm_topk_prob", True)  # Mixtral's: always
    assert config.shared_expert_intermediate_size == hf.get("shared_expert_intermediate_size", 0)
    assert config.qkv_bias == (architecture == "Qwen2MoeForCausalLM")


def test_decoder_sparse_step_and_mlp_only_layers_match_hf(tmp_path):
    """Qwen3-MoE with experts in layer 1 only: layers 1 and 3 by decoder_sparse_step 2,
    layer 3 back to a dense MLP by mlp_only_layers. (No GGUF: llama.cpp's MoE
    architectures have experts in every layer.)"""
    transformers = pytest.importorskip("transformers")
    from pagedllm.loader import load_model_source
    from pagedllm.models.llama import MLP
    from pagedllm.models.qwen3_moe import SparseMoeBlock
    tokenizer = load_model_source(None).tokenizer
    tokenizer.save_pretrained(str(tmp_path))
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=tokenizer.vocab_size, eos_token_id=2, bos_token_id=1,
        **{**MOE_SIZES, "num_hidden_layers": 4}, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[3], tie_word_embeddings=False)
    hf = transformers.Qwen3MoeForCausalLM(config).float().eval()
    _decisive_routing(hf)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=8 * 2**20)
    layers = llm.engine.model_runner.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [MLP, SparseMoeBlock, MLP, MLP]
    prompts = prompt_ids(llm)[:3]
    assert max_logit_error(llm, hf, prompts) < 1e-4


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok must be in 1..8"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
])
def test_config_rejects_impossible_expert_settings(change, message):
    from pagedllm.models.config import ModelConfig
    base = dict(architecture="qwen3_moe", vocab_size=100, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    ModelConfig(**base)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **change})


def test_a_gguf_whose_stacked_experts_do_not_match_its_expert_count_is_refused(models, tmp_path):
    import gguf
    from pagedllm.loader import ModelLoadError, load_model_source
    built, _, _ = models("qwen2-moe")
    for count in (5, 2**32 - 1):  # (the file holds 6)
        reader = gguf.GGUFReader(str(built.gguf), "r+")
        field = reader.fields["qwen2moe.expert_count"]
        field.parts[field.data[0]][0] = count
        path = tmp_path / f"{count}.gguf"
        path.write_bytes(bytes(reader.data))
        with pytest.raises(ModelLoadError, match=rf"has shape \[6, 32, 64\]; the model needs \[{count},"):
            load_model_source(str(path))


def test_a_config_declaring_more_experts_than_the_checkpoint_holds_is_refused(models, tmp_path):
    """A hostile expert count fails on the tensor count, before expert names are listed."""
    import json
    import shutil
    from pagedllm.loader import ModelLoadError, load_model_source
    built, _, _ = models("qwen2-moe")
    shutil.copytree(built.hf_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_experts": 10**9}))
    with pytest.raises(ModelLoadError, match="declares 1000000000 experts"):
        load_model_source(str(tmp_path / "m"))
