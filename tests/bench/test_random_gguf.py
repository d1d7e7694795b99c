"""Random GGUF files written block by block (bench/random_gguf.py): every type reads back
with the gguf package, with llama-quantize's choice of type per tensor, loads in pagedllm
and generates, and dequantizes to finite weights of the intended scale."""
from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench import random_model
from pagedllm.bench.random_gguf import GGUF_TYPES, STD, tensor_type, use_more_bits, write_random_gguf
from pagedllm.loader import load_model_source

T = gguf.GGMLQuantizationType
# tiny, with the shapes K-quants need (input features a multiple of 256); 8 layers so that
# use_more_bits picks some: layers 0, 3, 6 and 7
TINY = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
TINY_MOE = dict(TINY, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=256, tie_word_embeddings=False)


def types_of(path) -> dict[str, T]:
    return {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}


def test_use_more_bits_is_llama_cpps_rule():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21,
                                                              24, 27, 28, 29, 30, 31]


@pytest.mark.parametrize("tied", [True, False])
def test_q4_k_m_mixes_types_as_llama_quantize_does(tmp_path, tied):
    path = write_random_gguf("LlamaConfig", dict(TINY, tie_word_embeddings=tied),
                             tmp_path / "m.gguf", "Q4_K_M")
    types = types_of(path)
    more = {0, 3, 6, 7}
    for i in range(8):
        for role in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{role}.weight"] == (T.Q6_K if i in more else T.Q4_K)
        for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{role}.weight"] == T.Q4_K
        assert types[f"blk.{i}.attn_norm.weight"] == T.F32
    assert types["token_embd.weight"] == (T.Q6_K if tied else T.Q4_K)
    assert ("output.weight" in types) != tied
    if not tied:
        assert types["output.weight"] == T.Q6_K


def test_the_other_types_follow_their_rule():
    assert tensor_type("Q5_K_M", "ffn_down", 0, 8, False) == T.Q6_K
    assert tensor_type("Q5_K_M", "ffn_down", 1, 8, False) == T.Q5_K
    assert tensor_type("Q4_0", "output", 1, 8, False) == T.Q6_K
    assert tensor_type("Q8_0", "output", 1, 8, False) == T.Q8_0
    assert tensor_type("BF16", "output", 1, 8, False) == T.BF16
    assert tensor_type("Q4_K_M", "attn_v", 1, 8, False, n_experts=8) == T.Q8_0


def generates(path) -> bool:
    with LLM(str(path), kv_cache_memory_bytes=8 * 2**20) as llm:
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4,
                                                     ignore_eos=True), use_tqdm=False)
    return len(out[0].token_ids) == 4


@pytest.mark.parametrize("file_type", GGUF_TYPES)
def test_every_type_loads_in_pagedllm_with_weights_of_the_intended_scale(tmp_path, file_type):
    path = write_random_gguf("LlamaConfig", TINY, tmp_path / f"{file_type}.gguf", file_type)
    source = load_model_source(str(path))
    assert source.config.vocab_size == TINY["vocab_size"]
    for name, w in source.weights(torch.float32):
        assert torch.isfinite(w).all(), name
        if w.dim() == 2:
            assert 0.8 * STD < w.std().item() < 1.2 * STD, name
            assert abs(w.mean().item()) < 0.15 * STD, name
        else:
            assert torch.equal(w, torch.ones_like(w)), name
    if file_type == "Q4_K_M":  # the engine on every type: the slow test below
        assert generates(path)


@pytest.mark.slow
@pytest.mark.parametrize("file_type", GGUF_TYPES)
def test_every_type_generates_in_pagedllm(tmp_path, file_type):
    assert generates(write_random_gguf("LlamaConfig", TINY, tmp_path / "m.gguf", file_type))


@pytest.mark.parametrize("config_class,config", [
    ("Qwen3Config", dict(TINY, vocab_size=49152 + 100)),  # padded with unused tokens
    ("Qwen3MoeConfig", TINY_MOE),
])
def test_qwen3_and_qwen3_moe_files_load_and_generate(tmp_path, config_class, config):
    path = write_random_gguf(config_class, config, tmp_path / "q.gguf", "Q4_K_M")
    reader = gguf.GGUFReader(str(path))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    assert len(tokens.data) == config["vocab_size"]
    if "num_experts" in config:
        types = types_of(path)
        assert types["blk.1.ffn_down_exps.weight"] == T.Q6_K  # use_more_bits(1, 2)
        assert types["blk.0.ffn_down_exps.weight"] == T.Q4_K
        assert types["blk.0.ffn_gate_exps.weight"] == T.Q4_K
        assert types["blk.0.ffn_gate_inp.weight"] == T.F32
    assert load_model_source(str(path)).config.vocab_size == config["vocab_size"]
    assert generates(path)


def test_the_cli_writes_a_preset_as_gguf(tmp_path, monkeypatch):
    monkeypatch.setitem(random_model.PRESETS, "tiny", ("LlamaConfig", TINY))
    random_model.main(["tiny", str(tmp_path), "--gguf", "Q8_0"])
    assert types_of(tmp_path / "tiny-Q8_0.gguf")["blk.0.attn_q.weight"] == T.Q8_0
