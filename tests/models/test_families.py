"""Qwen2 / Qwen2.5, Mistral and Phi-3: tiny random models built with transformers' own
classes, every feature of the family on, loaded from an HF directory and from a GGUF: fp32
logits within 1e-4 of HF's, greedy replies equal to HF's under every engine setting, and
bf16 replies close to HF's bf16 by vLLM's rule. (Gemma: test_gemma.py; experts: test_moe.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from family_harness import (Family, SETTING_CASES, assert_beam_search_equals_hf, assert_bf16_close,
                            assert_int8_kv_close,
                            assert_greedy_matches_hf, assert_logits_match_hf, assert_tp2_equals_hf,
                            build, greedy, hf_greedy, models_fixture, prompt_ids)
from pagedllm import LLM
from pagedllm.loader import load_model_source


def _phi3_gguf_metadata(writer, config) -> None:
    """What convert_hf_to_gguf.py writes for Phi-3's partial rotary and LongRoPE."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _longrope(rotary_dims: int) -> dict:
    rng = np.random.default_rng(0)
    return dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                original_max_position_embeddings=48,
                short_factor=(1 + rng.random(rotary_dims // 2)).round(3).tolist(),
                long_factor=(2 + 4 * rng.random(rotary_dims // 2)).round(3).tolist())


FAMILIES = {f.name: f for f in [
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "qwen2",
           dict(tie_word_embeddings=False)),
    Family("qwen2-tied", "Qwen2ForCausalLM", "Qwen2Config", "qwen2",
           dict(tie_word_embeddings=True)),
    Family("mistral", "MistralForCausalLM", "MistralConfig", "llama",
           dict(sliding_window=12, tie_word_embeddings=False)),
    # head_dim 16 (hidden 64 / 4 heads), rotary on 8 dims; max 512 over an original 48
    Family("phi3", "Phi3ForCausalLM", "Phi3Config", "phi3",
           dict(rope_parameters=_longrope(8), tie_word_embeddings=False, pad_token_id=0),
           gguf_hook=_phi3_gguf_metadata),
]}


models = models_fixture(FAMILIES, "families")


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


def test_an_all_sliding_model_holds_kv_for_its_window_only(models, monkeypatch):
    """Mistral (window 12, blocks of 16): a 200-token generation frees the blocks that fall
    out of every layer's window, so it never holds more than cdiv(12, 16) + 1 blocks (+1
    for the block being filled); outputs still equal HF's."""
    from pagedllm.engine.block_manager import FREED_BLOCK, BlockManager
    built, prompts, _ = models("mistral")
    held = []
    real = BlockManager.allocate_slots

    def allocate_slots(self, seq, num_new_tokens, num_lookahead_tokens=0):
        copies = real(self, seq, num_new_tokens, num_lookahead_tokens)
        held.append(sum(b != FREED_BLOCK for b in seq.block_table))
        return copies

    monkeypatch.setattr(BlockManager, "allocate_slots", allocate_slots)
    llm = LLM(str(built.hf_dir), dtype="float32", kv_cache_memory_bytes=32 * 2**20,
              block_size=16, check_invariants=True)
    assert llm.engine.scheduler.block_manager.sliding_window == 12
    out = llm.generate([prompts[2]], greedy(200), use_tqdm=False)[0]
    assert len(prompts[2]) + 200 > 10 * 16
    assert max(held[1:]) <= 3, held          # after the prompt's own step
    assert out.token_ids == hf_greedy(built.hf, [prompts[2]], 200)[0]
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_interleaved_or_global_models_keep_every_block(models):
    built, _, _ = models("qwen2")
    llm = LLM(str(built.hf_dir), dtype="float32", kv_cache_memory_bytes=4 * 2**20)
    assert llm.engine.scheduler.block_manager.sliding_window is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_fast_paths_equal_the_op_by_op_forward(models, family):
    """bf16 with every fast path the family can take (C++ kernels, the one-call decode
    stack) gives the tokens the op-by-op forward (enforce_eager) gives."""
    built, prompts, _ = models(family)
    outs = []
    for eager in (False, True):
        llm = LLM(str(built.hf_dir), dtype="bfloat16", kv_cache_memory_bytes=16 * 2**20,
                  enforce_eager=eager)
        outs.append([o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_the_one_call_decode_stack_gives_the_per_op_results(models, family, dtype,
                                                            monkeypatch):
    """The decode stack adds Qwen2's q/k/v biases as the linear methods do, and passes
    Mistral's window (12, shorter than most prompts) to the attention kernel: its decode
    steps give the per-op forward's tokens and logprobs bit for bit (and it does run
    them), in bf16 and fp32."""
    from test_bf16 import assert_stack_equals_per_op  # tests/models (pytest's rootdir path)
    built, prompts, _ = models(family)
    assert_stack_equals_per_op(str(built.hf_dir), prompts, monkeypatch, dtype)


def test_longrope_takes_the_decode_stack_on_either_side_of_the_original_context(
        models, monkeypatch, tmp_path):
    """Phi-3's partial rotary and LongRoPE in the decode stack, with an original context of
    48 (transformers writes its configs' 4096 back, so the file is edited): two 40-token
    prompts cross it together and switch to the long factors inside the stack, with the
    per-op forward's tokens and logprobs bit for bit. A batch whose rows straddle it (one
    longer, one not) runs those steps op by op, and the others in the stack."""
    import json
    import shutil

    from decode_stack_counts import counting_stack_steps  # tests/ (pytest prepends the rootdir)
    from test_bf16 import assert_stack_equals_per_op
    built, prompts, _ = models("phi3")
    model = tmp_path / "phi3"
    shutil.copytree(built.hf_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["original_max_position_embeddings"] = 48
    config["rope_parameters"]["original_max_position_embeddings"] = 48
    (model / "config.json").write_text(json.dumps(config))
    ids = [t for p in prompts for t in p]
    long_prompts = [ids[:40], ids[40:80]]
    assert len(long_prompts[1]) == 40
    assert_stack_equals_per_op(str(model), long_prompts, monkeypatch)
    kwargs = dict(dtype="bfloat16", kv_cache_memory_bytes=16 * 2**20, max_model_len=512,
                  enable_prefix_caching=False)
    llm = LLM(str(model), **kwargs)
    assert llm.engine.model_runner.model.model.layers[0].self_attn.rotary_emb.long_after == 48
    straddling = [long_prompts[0], long_prompts[1][:30]]  # long from steps 9 and 19 on
    counts = counting_stack_steps(monkeypatch)
    ours = llm.generate(straddling, greedy(24, logprobs=3), use_tqdm=False)
    assert counts["stack"] == 23 - 10, counts
    per_op = LLM(str(model), enforce_eager=True, **kwargs).generate(
        straddling, greedy(24, logprobs=3), use_tqdm=False)
    for a, b in zip(ours, per_op):
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


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


def test_an_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    import json

    from pagedllm.loader import ModelLoadError, load_model_source
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM.*supported: .*Mistral"
                                             "ForCausalLM.*Qwen2ForCausalLM.*Phi3ForCausalLM"):
        load_model_source(str(tmp_path))


def test_a_tensor_that_does_not_match_the_config_is_named_with_both_shapes(models, tmp_path):
    import json
    import shutil

    from pagedllm.loader import ModelLoadError, load_model_source
    built, _, _ = models("phi3")
    copy = tmp_path / "phi3"
    shutil.copytree(built.hf_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 96                    # the checkpoint's is 128
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' "
                                             r"has shape \[\d+, \d+\], but the model's "
                                             r"hyper-parameters need \[\d+, \d+\]"):
        load_model_source(str(copy))


@pytest.mark.slow
def test_the_server_serves_a_family_with_the_official_client(models, start_server):
    """`pagedllm serve` on the GGUF of a family other than Llama: the openai client's
    completions (token-id prompts, greedy) equal HF's replies; chat uses the file's template."""
    openai = pytest.importorskip("openai")
    built, prompts, reference = models("phi3")
    proc = start_server("phi3-server", ["--model", str(built.gguf), "--max-model-len", "256"])
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        tokenizer = load_model_source(str(built.gguf)).tokenizer
        for ids, ref in list(zip(prompts, reference))[:3]:
            out = client.completions.create(model=model, prompt=ids, max_tokens=len(ref),
                                            temperature=0, extra_body={"min_tokens": len(ref)})
            assert out.choices[0].text == tokenizer.decode(ref)
        chat = client.chat.completions.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Hello"}])
        assert chat.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.stop_and_check()


def test_a_window_wider_than_every_context_takes_the_cpp_kernels(tmp_path, monkeypatch):
    """Mistral with a 256-token window and contexts under 110 tokens: the window hides
    nothing, so the C++ kernels attend (not torch's masked path); replies equal HF's."""
    from pagedllm.attention import torch_native
    wide = Family("mistral-wide", "MistralForCausalLM", "MistralConfig", "llama",
                  dict(sliding_window=256, tie_word_embeddings=False))
    built = build(wide, tmp_path)
    calls = []
    real = torch_native.attention
    monkeypatch.setattr(torch_native, "attention",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    llm = LLM(str(built.hf_dir), dtype="float32", kv_cache_memory_bytes=16 * 2**20)
    if llm.engine.model_runner.attention_backend != "cpu_paged":
        pytest.skip("the C++ kernels did not build here")
    prompts = prompt_ids(llm)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert not calls
    assert [o.token_ids for o in outs] == hf_greedy(built.hf, prompts)
