"""Randomly initialised models with real families' exact shapes, for speed measurements
(speed does not depend on weight values; no model is downloaded).

    python -m pagedllm.bench.random_model qwen2.5-0.5b /tmp/qwen2.5-0.5b
    pagedllm bench throughput --model /tmp/qwen2.5-0.5b --compare hf
    python -m pagedllm.bench.random_model llama-3-8b /tmp/models --gguf Q4_K_M

Each preset is the published config.json of the model it names, built with transformers'
own class; the largest keep their per-layer shapes with fewer layers (the name says so)
so that they fit beside HF transformers in 24 GiB. The bundled model's tokenizer is saved
beside the weights (the benchmarks send token ids drawn within its vocabulary); where the
bundled model's package is not installed (a bare GPU machine), or with --synthetic-tokenizer,
a word-level tokenizer of the model's vocabulary size instead (token ids are all the
benchmarks send; its text is meaningless, as theirs is).

--gguf TYPE writes the Llama and Qwen3 presets as one GGUF file of that quantization type
instead (bench/random_gguf.py: block by block, never the whole model in memory).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm.bench.random_gguf import GGUF_TYPES

# name -> (transformers config class, config kwargs)
_LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "qwen3-1.7b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "llama-3.2-3b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "llama-3-8b": ("LlamaConfig", dict(  # Llama-3.1-8B's shapes and rope scaling
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "mistral-7b-8layers": ("MistralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "phi-4-mini-8layers": ("Phi3Config", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                          long_factor=[1.0 + i / 8 for i in range(48)]),
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0)),
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(26)])),
    "gemma-2-2b": ("Gemma2Config", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6)),
    "mixtral-8x7b-2layers": ("MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
}
# Qwen3's architecture at a toy size: the CPU rehearsal of scripts/gpu_bench.sh
PRESETS["qwen3-tiny"] = ("Qwen3Config", dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True))
# Qwen3-30B-A3B with 4 of its 48 layers: fits the 24 GiB machines in bf16
PRESETS["qwen3-30b-a3b-4layers"] = ("Qwen3MoeConfig",
                                    {**PRESETS["qwen3-30b-a3b"][1], "num_hidden_layers": 4})

# what transformers' class is called for each config class
_MODEL_CLASSES = {"Qwen3Config": "Qwen3ForCausalLM", "LlamaConfig": "LlamaForCausalLM",
                  "Qwen2Config": "Qwen2ForCausalLM", "MistralConfig": "MistralForCausalLM",
                  "Phi3Config": "Phi3ForCausalLM", "Gemma3TextConfig": "Gemma3ForCausalLM",
                  "Gemma2Config": "Gemma2ForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
                  "MixtralConfig": "MixtralForCausalLM"}


def make_random_model(preset: str, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0, synthetic_tokenizer: bool = False,
                      device: str = "cpu") -> str:
    """Save the preset's randomly initialised model (and the bundled tokenizer, or a
    synthetic one: save_tokenizer) to out_dir. device: where the weights are drawn (a GPU
    draws Qwen3-0.6B's in well under a second, a CPU in several)."""
    import transformers

    config_class, kwargs = PRESETS[preset]
    config = getattr(transformers, config_class)(bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    model_class = getattr(transformers, _MODEL_CLASSES[config_class])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # built in dtype: a 4B model in fp32 would double the peak
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, config.vocab_size, synthetic_tokenizer)
    return out_dir


def save_tokenizer(out_dir: str, vocab_size: int, synthetic: bool = False) -> str:
    """The bundled model's tokenizer, else (package missing, or synthetic) a word-level one
    of vocab_size tokens ("<unk>", "<s>", "</s>", then "t3", "t4", ...; BOS 1 and EOS 2 as
    the presets' configs say). Returns which one was saved."""
    from pagedllm.loader import ModelLoadError, load_model_source
    if not synthetic:
        try:
            load_model_source(None).tokenizer.save_pretrained(out_dir)
            return "bundled"
        except ModelLoadError as e:
            print(f"random_model: {e}; saving a synthetic word-level tokenizer instead")
    from tokenizers import Tokenizer, models, pre_tokenizers
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "bos_token": "<s>", "eos_token": "</s>"}
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return "synthetic"


def make_random_gguf(preset: str, out_dir: str, gguf_type: str, seed: int = 0,
                     progress: bool = False) -> str:
    """Write the preset as out_dir/{preset}-{gguf_type}.gguf (random_gguf.py); its path."""
    from pagedllm.bench.random_gguf import write_random_gguf
    config_class, kwargs = PRESETS[preset]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"{preset}-{gguf_type}.gguf"
    return str(write_random_gguf(config_class, kwargs, path, gguf_type, name=preset,
                                 seed=seed, progress=progress))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the random weights are drawn (HF directories only)")
    parser.add_argument("--synthetic-tokenizer", action="store_true",
                        help="save a word-level tokenizer of the model's vocabulary size, not "
                             "the bundled model's (which is the fallback when its package is "
                             "missing)")
    parser.add_argument("--gguf", metavar="TYPE", choices=GGUF_TYPES, default=None,
                        help=f"write one GGUF file of this type instead of an HF directory "
                             f"(Llama and Qwen3 presets): {', '.join(GGUF_TYPES)}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.gguf:
        out = make_random_gguf(args.preset, args.out_dir, args.gguf, progress=True)
    else:
        out = make_random_model(args.preset, args.out_dir, getattr(torch, args.dtype),
                                synthetic_tokenizer=args.synthetic_tokenizer, device=args.device)
    print(f"{args.preset}: saved to {out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
