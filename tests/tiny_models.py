"""A tiny random Llama written as a GGUF file, as llama.cpp lays one out.

It loads and runs in milliseconds, so tests that only need *an* engine (invariant
violations, fault paths) or a valid file to mutate (loader fuzzing) do not pay for the
bundled 135M model. Its outputs are meaningless; never compare them with anything.

make_qwen3_dir: a small random Qwen3 saved by transformers as an HF directory, for tests
that compare one engine setting with another (tensor parallelism, attention backends).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, context=256)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level vocabulary: 4 control tokens + 256 bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<eot>"] + alphabet + ["Ġt"]
    return tokens, [3, 3, 3, 3] + [1] * (len(alphabet) + 1), ["Ġ t"]


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """llama.cpp tensor names -> float32 arrays in HF (row-major) shape."""
    rng = np.random.default_rng(seed)
    t = TINY
    h, hd, vocab = t["hidden"], t["head_dim"], len(tiny_vocab()[0])

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    weights = {"token_embd.weight": w(vocab, h), "output_norm.weight": 1 + w(h)}
    for i in range(t["layers"]):
        weights.update({
            f"blk.{i}.attn_norm.weight": 1 + w(h), f"blk.{i}.ffn_norm.weight": 1 + w(h),
            f"blk.{i}.attn_q.weight": w(t["heads"] * hd, h),
            f"blk.{i}.attn_k.weight": w(t["kv_heads"] * hd, h),
            f"blk.{i}.attn_v.weight": w(t["kv_heads"] * hd, h),
            f"blk.{i}.attn_output.weight": w(h, t["heads"] * hd),
            f"blk.{i}.ffn_gate.weight": w(t["ffn"], h), f"blk.{i}.ffn_up.weight": w(t["ffn"], h),
            f"blk.{i}.ffn_down.weight": w(h, t["ffn"]),
        })
    return weights


def write_tiny_llama_gguf(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny model (tied embeddings, byte-level BPE tokenizer, chat template)."""
    path = Path(path)
    t = TINY
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(t["layers"])
    writer.add_context_length(t["context"])
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokens, types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                             "<|im_start|>assistant\n{% endif %}")
    for name, value in tiny_weights(seed).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_qwen3_dir(path: Path, num_kv_heads: int) -> Path:
    """A small random Qwen3 (4 heads) saved by transformers as an HF directory."""
    import torch
    import transformers

    from pagedllm.loader import load_model_source
    tokenizer = load_model_source(None).tokenizer
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=num_kv_heads,
        head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return path
