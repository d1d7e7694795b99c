"""GGUF files of the types users download (Q4_K_M's mix of Q4_K, Q5_K and Q6_K; Q8_0; Q4_0
and Q4_1), written with random but valid blocks for tiny Llama, Qwen3 and Qwen2 models whose
HF twins hold the gguf package's dequantization of the same blocks (the reference values):

- dequantized (quantization="none", fp32) the engine equals HF: logits within 1e-4, greedy
  tokens equal (the loader reads every type and moves Llama's permuted q/k rows of blocks);
- kept quantized (the default for a GGUF) every linear and the embedding compute from the
  file's blocks, held once, and greedy replies pass vLLM's closeness rule against HF fp32,
  on the AVX-512 kernel path and on the AVX2 one;
- the one-call decode stack gives the per-op forward's tokens and logprobs bit for bit with
  them (a layer whose q/k/v mix Q4_K and Q6_K included);
- mixture-of-experts models keep their experts quantized too (Qwen3-MoE with K-quants,
  Mixtral's Llama-arch GGUF with Q8_0).
"""
from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from family_harness import (Family, build, first_difference, greedy, hf_greedy,
                            max_logit_error, prompt_ids)
from test_moe import _decisive_routing  # tests/models (pytest's rootdir path)
from cpu_features import cpu_flags, cpu_has_amx_int8
from pagedllm import LLM
from pagedllm.kernels import ops, probes
from pagedllm.layers import quantized
from pagedllm.layers.gguf_packing import SUPPORTED_TYPES
from pagedllm.layers.linear import LinearBase
from pagedllm.loader.model_loader import linear_kernels
from pagedllm.layers.moe import FusedMoE

K_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=512)


def _q4_k_m(name: str):
    """llama-quantize's Q4_K_M in miniature: Q4_K, with Q6_K for the head and layer 0's v
    and down projections (its "more bits" layers), and Q5_K for the other downs."""
    if "lm_head" in name or (".0." in name and ("v_proj" in name or "down_proj" in name)):
        return Q.Q6_K
    return Q.Q5_K if "down_proj" in name else Q.Q4_K


def _experts_k(name: str):
    """Experts' gate/up as Q4_K, down as Q6_K; everything else Q8_0."""
    if ".experts." in name:
        return Q.Q6_K if "down_proj" in name else Q.Q4_K
    return Q.Q8_0


def _q4_0(name: str):
    return Q.Q8_0 if "embed" in name else Q.Q4_1 if "o_proj" in name else Q.Q4_0


FAMILIES = {f.name: f for f in [
    Family("llama-q4_k_m", "LlamaForCausalLM", "LlamaConfig", "llama",
           dict(tie_word_embeddings=False), sizes=K_SIZES, quantize=_q4_k_m),
    Family("qwen3-q8_0", "Qwen3ForCausalLM", "Qwen3Config", "qwen3",
           dict(tie_word_embeddings=True), sizes=K_SIZES, quantize=lambda name: Q.Q8_0),
    Family("qwen2-q4_0", "Qwen2ForCausalLM", "Qwen2Config", "qwen2",
           dict(tie_word_embeddings=True), sizes={**K_SIZES, "num_attention_heads": 8,
                                                  "head_dim": 32}, quantize=_q4_0),
    # experts kept quantized too: K-quants (Qwen3-MoE), Q8_0 with Llama-arch names (Mixtral)
    Family("qwen3-moe-k", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen3moe",
           dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                norm_topk_prob=True, tie_word_embeddings=False),
           sizes=K_SIZES, init=_decisive_routing, quantize=_experts_k),
    Family("mixtral-q8_0", "MixtralForCausalLM", "MixtralConfig", "llama",
           dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
           sizes={**K_SIZES, "intermediate_size": 64}, init=_decisive_routing,
           quantize=lambda name: None if name.endswith("mlp.gate.weight") else Q.Q8_0),
]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    if not probes.gguf_linear_available():
        pytest.skip("the GGUF kernel needs a CPU and build with AVX2 or AVX-512")
    root = tmp_path_factory.mktemp("gguf-quantized")
    cache = {}

    def get(name: str):
        if name not in cache:
            built = build(FAMILIES[name], root)
            prompts = prompt_ids(LLM(str(built.gguf), quantization="none", dtype="float32",
                                     kv_cache_memory_bytes=4 * 2**20))
            cache[name] = built, prompts, hf_greedy(built.hf, prompts, 16)
        return cache[name]

    return get


def _engine(built, **kwargs) -> LLM:
    return LLM(str(built.gguf), kv_cache_memory_bytes=16 * 2**20, max_model_len=512, **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dequantized_the_file_equals_hf_fp32(models, family):
    built, prompts, reference = models(family)
    llm = _engine(built, quantization="none", dtype="float32")
    assert max_logit_error(llm, built.hf, prompts) < 1e-4
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kept_quantized_by_default_every_weight_is_the_files_held_once(models, family):
    built, _, _ = models(family)
    llm = _engine(built)
    assert llm.engine.config.quantization == "gguf"
    model = llm.engine.model_runner.model
    quantize = FAMILIES[family].quantize
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    embed = model.model.embed_tokens
    for name, m in linears:
        if name.endswith("mlp.gate"):  # a router: F32 in the file
            continue
        assert m.gguf_parts is not None and m.weight.numel() == 0, name
    for m in model.modules():
        if isinstance(m, FusedMoE):
            assert m.gguf_experts is not None and m.w13.numel() == m.w2.numel() == 0
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.gguf_parts is embed.gguf_parts) == tied
    assert embed.gguf_parts[0].qtype == quantize("model.embed_tokens.weight")
    types = [quantize(f"model.layers.0.self_attn.{x}_proj.weight") for x in "qkv"]
    runs = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert [p.qtype for p in qkv.gguf_parts] == runs  # Q4_K_M's layer 0: two parts
    # held once: the packings are at most 1.15x the file's tensors (1.0-1.11x by type)
    reader = gguf.GGUFReader(str(built.gguf))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors
                     if t.tensor_type in SUPPORTED_TYPES)
    assert quantized.packed_bytes(model) <= 1.15 * file_bytes


def _assert_close_to_hf(llm: LLM, built, prompts, reference) -> None:
    """vLLM's closeness rule against HF fp32 on the dequantized weights, and most tokens
    agreeing (not a lucky walk through top-5 sets)."""
    outs = llm.generate(prompts, greedy(16, logprobs=5), use_tqdm=False)
    agreed = 0
    for ids, out, ref in zip(prompts, outs, reference):
        ours = out.token_ids
        i = first_difference(ours, ref)
        agreed += len(ref) if i is None else i
        if i is None:
            continue
        with torch.no_grad():
            theirs_top5 = built.hf(torch.tensor([ids + ref[:i]])).logits[0, -1].topk(5).indices
        assert ref[i] in {t for t, _ in out.outputs[0].logprobs[i].top}, (ids[:5], i)
        assert ours[i] in theirs_top5.tolist(), (ids[:5], i)
    assert agreed >= len(prompts) * 16 // 2, agreed


NO_AMX = pytest.mark.skipif(not cpu_has_amx_int8(), reason="this CPU has no AMX-INT8")
NO_AVX512 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX512-BF16")


@pytest.mark.parametrize("isa", ["best", "avx2", pytest.param("avx512_bf16", marks=NO_AVX512)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kept_quantized_greedy_is_close_to_hf(models, family, isa):
    """Every path of the GGUF kernel the CPU has: the best one unasked (AMX where the CPU has
    it), AVX2, and AVX512-BF16 (which AMX CPUs also have)."""
    built, prompts, reference = models(family)
    llm = _engine(built)
    if isa != "best":
        ops.force_gguf_linear_isa(isa)
    try:
        best = ("amx" if cpu_has_amx_int8() else
                "avx512_bf16" if "avx512_bf16" in cpu_flags() else "avx2")
        assert ops.gguf_linear_isa() == (best if isa == "best" else isa)
        _assert_close_to_hf(llm, built, prompts, reference)
    finally:
        ops.force_gguf_linear_isa("")


@NO_AMX
def test_on_amx_each_prompt_alone_gives_its_tokens_in_the_batch(models):
    """AMX CPUs run the GGUF linears on tiles from 6 rows and on VNNI below, to the same sums:
    the linears name the AMX path, and each prompt alone (one-row decode steps) gives the
    tokens it gives in the batch (prompt chunks and decode batches on tiles)."""
    built, prompts, _ = models("llama-q4_k_m")
    llm = _engine(built)
    kernels = linear_kernels(llm.engine.model_runner.model)
    assert "gguf_linear (amx)" in kernels and "avx512" not in kernels, kernels
    together = [o.token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
    alone = [llm.generate([p], greedy(16), use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == together


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_stack_gives_the_per_op_results_with_the_files_weights(models, family,
                                                                      monkeypatch):
    from test_bf16 import assert_stack_equals_per_op  # tests/models (pytest's rootdir path)
    built, prompts, _ = models(family)
    assert_stack_equals_per_op(str(built.gguf), prompts, monkeypatch, dtype="auto")
