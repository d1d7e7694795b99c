"""Gemma 2 and Gemma 3 (text): tiny random models built with transformers' own classes,
every feature of the family on, loaded from an HF directory and from a GGUF written as
llama.cpp's converter writes one (norm weights stored as 1 + w): fp32 logits within 1e-4 of
HF's, greedy replies equal to HF's under every engine setting, and bf16 replies close to
HF's bf16 by vLLM's rule. Then the configurations only one of the two formats can hold,
and the checkpoints pagedllm refuses."""
from __future__ import annotations

import json
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from family_harness import (Family, SETTING_CASES, assert_beam_search_equals_hf, assert_bf16_close,
                            assert_int8_kv_close,
                            assert_greedy_matches_hf, assert_logits_match_hf, assert_tp2_equals_hf,
                            greedy, max_logit_error, models_fixture)
from pagedllm.kernels import probes
from pagedllm import LLM
from pagedllm.engine.cpu_decode_stack import CpuDecodeStack, _StackArgs
from pagedllm.loader import ModelLoadError, load_model_source
from pagedllm.loader.gguf_loader import config_from_metadata
from pagedllm.loader.hf_loader import config_from_hf
from pagedllm.loader.validate import model_bytes
from pagedllm.models.gemma import Gemma3ForCausalLM


def _norm_plus_one(name: str, data: np.ndarray) -> np.ndarray:
    """convert_hf_to_gguf.py's Gemma 2/3 modify_tensors: every norm weight w as 1 + w."""
    return data + 1 if name.endswith("norm.weight") else data


def _gemma2_gguf_metadata(writer, config) -> None:
    """What convert_hf_to_gguf.py's Gemma2Model adds (the window is written for every
    family): both soft-caps."""
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _gemma3_gguf_metadata(writer, config) -> None:
    """What convert_hf_to_gguf.py's Gemma3Model adds: a final soft-cap if the model has one
    (the global and sliding rope bases and the global linear scaling are its TextModel's,
    written for every family)."""
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _sharpen(model: torch.nn.Module) -> None:
    """q, k and the (tied) embeddings x4: attention scores of a few units and logits up to
    ~6, where the soft-caps (5) bend them and the rope bases tell positions apart."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("q_proj", "k_proj", "embed_tokens")):
                p.mul_(4)


GEMMA2_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    max_position_embeddings=512)
FAMILIES = {f.name: f for f in [
    # head_dim 256 (2 heads over hidden 64); layers sliding, global, sliding; window 8
    Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config", "gemma2",
           dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                sliding_window=8, query_pre_attn_scalar=256, attn_logit_softcapping=5.0,
                final_logit_softcapping=5.0, tie_word_embeddings=True),
           gguf_hook=_gemma2_gguf_metadata, gguf_transform=_norm_plus_one, init=_sharpen,
           sizes=GEMMA2_SIZES),
    # 7 layers: llama.cpp's (and HF 4.x's) pattern of 6 makes layer 5 the global one;
    # window 12; sliding layers' rope base 10000, the global one's 1e6 scaled linearly x8
    Family("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", "gemma3",
           dict(sliding_window=12, query_pre_attn_scalar=16, tie_word_embeddings=True,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1_000_000.0}}),
           gguf_hook=_gemma3_gguf_metadata, gguf_transform=_norm_plus_one, init=_sharpen,
           sizes=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512)),
]}
# A GGUF holds no query_pre_attn_scalar (llama.cpp derives it: test below), so a scalar
# other than head_dim (Gemma 2 27B's hidden / heads) is checked from the HF directory only
SCALAR = Family("gemma2-scalar", "Gemma2ForCausalLM", "Gemma2Config", "gemma2",
                dict(sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
                     final_logit_softcapping=5.0), init=_sharpen, sizes=GEMMA2_SIZES)


models = models_fixture({**FAMILIES, SCALAR.name: SCALAR}, "gemma")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(models, family, fmt):
    assert_logits_match_hf(models(family), fmt)


def test_query_pre_attn_scalar_from_hf_config(models):
    built, prompts, _ = models(SCALAR.name)
    llm = LLM(built.path("hf"), dtype="float32", kv_cache_memory_bytes=32 * 2**20)
    assert llm.engine.model_runner.model.config.attention_scale == 32 ** -0.5
    assert max_logit_error(llm, built.hf, prompts) < 1e-4


@pytest.mark.parametrize("setting", SETTING_CASES)
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf(models, family, fmt, setting):
    assert_greedy_matches_hf(models(family), fmt, setting)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_2_equals_hf(models, family):
    built, prompts, reference = models(family)
    assert_tp2_equals_hf(built, prompts, reference)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_beam_search_equals_hf(models, family):
    built, prompts, _ = models(family)
    assert_beam_search_equals_hf(built, prompts[:4])


def test_int8_kv_cache_close_to_hf(models):
    """kv_cache_dtype="int8" under fp32 activations: vLLM's closeness rule against HF."""
    built, prompts, reference = models("gemma2")
    assert_int8_kv_close(built, "hf", prompts, reference)


def test_int8_kv_cache_errors_stay_near_a_bf16_caches(models):
    """Gemma 3's tiny model (q, k and embeddings sharpened x4: scores up to ~6) is the most
    sensitive to K/V rounding: a bf16 cache moves its chosen tokens' log-probabilities by
    up to 0.11 from HF's, an int8 cache by up to 0.46, and at one token of one prompt the
    int8 run's choice leaves HF's top 5 (vLLM's rule fails there). What holds: the int8
    cache's largest error is within 8x the bf16 cache's (measured 4x) on the same replies."""
    built, prompts, _ = models("gemma3")
    errors = {}
    for kv in ("bfloat16", "int8"):
        llm = LLM(str(built.hf_dir), dtype="float32", kv_cache_dtype=kv,
                  kv_cache_memory_bytes=32 * 2**20)
        outs = llm.generate(prompts, greedy(16, logprobs=1), use_tqdm=False)
        worst = 0.0
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                ref = built.hf(torch.tensor([ids + out.token_ids])).logits[0].log_softmax(-1)
            for i, (t, lp) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
                worst = max(worst, abs(ref[len(ids) - 1 + i, t].item() - dict(lp.top)[t]))
        errors[kv] = worst
    assert 0 < errors["int8"] < 8 * errors["bfloat16"], errors


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_close_to_hf_bf16(models, family):
    built, prompts, _ = models(family)
    assert_bf16_close(built, "hf", prompts)


def test_gguf_config_equals_hf_config(models):
    """Everything llama.cpp's converter keeps (or its loader derives) reads back as HF's."""
    for family in FAMILIES:
        built, _, _ = models(family)
        ours, theirs = (load_model_source(built.path(fmt)).config for fmt in ("gguf", "hf"))
        for name in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_theta",
                     "rope_local_theta", "rope_scaling", "attn_logit_softcapping",
                     "final_logit_softcapping", "hidden_act", "tie_word_embeddings"):
            assert getattr(ours, name) == getattr(theirs, name), (family, name)


@pytest.mark.parametrize("family", [*FAMILIES, SCALAR.name])
def test_gemma_layers_take_the_one_call_decode_stack_with_the_per_op_results(models, family,
                                                                             monkeypatch):
    """The decode stack runs Gemma's layers (four (1 + w) norms, GeGLU, the attention scale,
    soft-capped scores, sliding layers whose windows the prompts outgrow, each layer's rope
    base): every decode step takes it, with the per-op forward's tokens and logprobs bit for
    bit."""
    from test_bf16 import assert_stack_equals_per_op  # tests/models (pytest's rootdir path)
    built, prompts, _ = models(family)
    window = load_model_source(built.path("hf")).config.sliding_window
    assert max(len(p) for p in prompts) > window
    assert_stack_equals_per_op(str(built.hf_dir), prompts, monkeypatch)


@pytest.mark.skipif(not probes.has_avx512_bf16(),
                    reason="the one-call decode stack needs AVX512-BF16 (this CPU lacks it)")
def test_gemma_decoders_take_the_decode_stack(models):
    built, _, _ = models("gemma3")
    model = Gemma3ForCausalLM(load_model_source(built.path("hf")).config)
    assert CpuDecodeStack.for_model(model, torch.bfloat16) is not None
    # not bound to cpu_paged and a KV cache yet
    assert _StackArgs.gather(model.model, torch.bfloat16) is None


def test_model_size_estimate_counts_both_rope_tables(models):
    """check_fits_in_memory's estimate holds Gemma 3's second (sliding layers') rope tables."""
    built, _, _ = models("gemma3")
    config = load_model_source(built.path("gguf")).config
    model = Gemma3ForCausalLM(config)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    assert model_bytes(config, torch.float32) == sum(t.numel() * t.element_size()
                                                     for t in tensors.values())


# ----------------------------------------------------------------------------- configurations

def _hf4(**fields) -> dict:
    """A transformers 4.x style config.json (no layer_types, flat rope fields)."""
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, sliding_window=12,
                query_pre_attn_scalar=16, **fields)


def test_hf4_gemma2_config_alternates_layers():
    config = config_from_hf(_hf4(architectures=["Gemma2ForCausalLM"], rope_theta=10000.0,
                                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                            "gemma-2")
    assert config.layer_types == ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"]
    assert [config.layer_window(i) for i in range(2)] == [12, None]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)


def test_hf4_gemma3_config_pattern_and_rope_bases():
    config = config_from_hf(_hf4(architectures=["Gemma3ForCausalLM"], sliding_window_pattern=3,
                                 rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                                 rope_scaling={"rope_type": "linear", "factor": 8.0},
                                 attn_logit_softcapping=50.0), "gemma-3")
    sliding, full = "sliding_attention", "full_attention"
    assert config.layer_types == [sliding, sliding, full, sliding, sliding, full, sliding]
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.attn_logit_softcapping is None  # HF's Gemma 3 never applies it


def _gguf_metadata(arch: str, layers: int, **keys) -> dict:
    meta = {"general.architecture": arch, f"{arch}.embedding_length": 64,
            f"{arch}.feed_forward_length": 128, f"{arch}.block_count": layers,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.key_length": 32,
            f"{arch}.vocab_size": 256}
    meta.update({f"{arch}.{k}": v for k, v in keys.items()})
    return meta


@pytest.mark.parametrize("arch,layers,scalar", [("gemma2", 42, 32), ("gemma2", 46, 16),
                                                 ("gemma3", 34, 32), ("gemma3", 62, 16)])
def test_gguf_attention_scale_follows_llama_cpp(arch, layers, scalar):
    """llama.cpp scales by head_dim ** -0.5, but the 27B models' by (hidden / heads) ** -0.5
    (what their HF query_pre_attn_scalar says); it knows them by their block count."""
    meta = _gguf_metadata(arch, layers, **{"attention.sliding_window": 8})
    config = config_from_metadata(meta, SimpleNamespace(tensors=[]), "x.gguf")
    assert config.query_pre_attn_scalar == scalar


def test_gguf_gemma_defaults_follow_llama_cpp():
    """Gemma 2 without the keys: window 4096 and soft-caps 50 / 30; Gemma 3 without a window:
    every layer global, local rope base 10000, a sliding pattern array read per layer."""
    g2 = config_from_metadata(_gguf_metadata("gemma2", 4), SimpleNamespace(tensors=[]), "x")
    caps = (g2.attn_logit_softcapping, g2.final_logit_softcapping)
    assert (g2.sliding_window, caps) == (4096, (50.0, 30.0))
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 2
    g3 = config_from_metadata(_gguf_metadata("gemma3", 4), SimpleNamespace(tensors=[]), "x")
    assert (g3.sliding_window, g3.layer_types, g3.rope_local_theta) == (None, None, 10000.0)
    g3 = config_from_metadata(_gguf_metadata("gemma3", 3, **{
        "attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False, True],
        "rope.freq_base_swa": 20000.0, "final_logit_softcapping": 0.0}),
        SimpleNamespace(tensors=[]), "x")
    assert g3.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (g3.rope_local_theta, g3.final_logit_softcapping) == (20000.0, None)


# ----------------------------------------------------------------------------- refused

def test_hf_gemma3_multimodal_is_refused_by_name(tmp_path):
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"model_type": "gemma3_text", "hidden_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration") as info:
        load_model_source(str(tmp_path))
    assert "Gemma3ForCausalLM" in str(info.value) and "text model" in str(info.value)


def test_hf_bidirectional_gemma3_is_refused():
    with pytest.raises(ModelLoadError, match="bidirectional attention"):
        config_from_hf(_hf4(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
                       "embeddinggemma")


def test_gguf_mmproj_is_refused_by_name(tmp_path):
    path = tmp_path / "mmproj-gemma-3.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="multimodal projector") as info:
        load_model_source(str(path))
    assert "text models" in str(info.value)
