"""Random GGUF files with real models' shapes, in the quantization types llama.cpp users
download (F16, BF16, Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K), written block by block: no float copy
of the model is ever built, so an 8B Q4_K_M (4.6 GiB) is written in ~0.2 GiB of memory.

    python -m pagedllm.bench.random_model llama-3-8b /tmp/models --gguf Q4_K_M

Each weight's blocks hold random quants with fixed, valid scale fields, chosen so that the
dequantized weights have a standard deviation of ~0.02 and mean ~0 (uniform, not normal;
speed does not depend on values); norms are 1. Which tensors take which type follows
llama.cpp's llama-quantize (src/llama-quant.cpp, llama_tensor_get_type): see tensor_type.
Tensor names come from the `gguf` package's maps, metadata through its GGUFWriter, and the
tokenizer is the bundled SmolLM2's, padded with unused "[PAD{i}]" tokens up to the preset's
vocabulary (as convert_hf_to_gguf.py pads a vocabulary smaller than the embedding).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import MODEL_TENSOR as MT

from pagedllm.loader import default_model_path
from pagedllm.loader.gguf_loader import open_gguf

GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
# each file type's base tensor type and llama.cpp's file type code (general.file_type)
_FILE_TYPES: dict[str, tuple[T, gguf.LlamaFileType]] = {
    "F16": (T.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (T.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (T.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q4_K_M": (T.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (T.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (T.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
}
_ARCHS = {"LlamaConfig": "llama", "Qwen3Config": "qwen3", "Qwen3MoeConfig": "qwen3moe"}
STD = 0.02          # the dequantized weights' standard deviation
CHUNK_BYTES = 32 * 2**20  # written per call: peak memory is a few of these


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third
    in between take the larger type in the _M mixes."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def tensor_type(file_type: str, role: str, layer: int, n_layers: int, tied: bool,
                n_experts: int = 0) -> T:
    """The type llama-quantize gives a 2-D (or 3-D expert) weight of role ("token_embd",
    "output", "attn_v", "ffn_down", ... as in the tensor's name) in layer of n_layers.
    F16/BF16 files are what convert_hf_to_gguf.py writes: every weight in that type. In a
    quantized file the output matrix (or the tied token embedding, which is it) takes Q6_K
    (Q8_0 in a Q8_0 file); in Q4_K_M and Q5_K_M, attn_v and ffn_down of use_more_bits
    layers take Q6_K. With exactly 8 experts (Mixtral), attn_k and attn_v take Q8_0."""
    base = _FILE_TYPES[file_type][0]
    if base in (T.F16, T.BF16):
        return base
    if role == "output" or (role == "token_embd" and tied):
        return T.Q8_0 if base == T.Q8_0 else T.Q6_K
    if n_experts == 8 and role in ("attn_k", "attn_v"):
        return T.Q8_0
    if (file_type in ("Q4_K_M", "Q5_K_M") and role in ("attn_v", "ffn_down", "ffn_down_exps")
            and use_more_bits(layer, n_layers)):
        return T.Q6_K
    return base


# ---- blocks ------------------------------------------------------------------------------

def _f16(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


@dataclass(frozen=True)
class _Layout:
    """Where a block's fixed fields lie: (byte offset, bytes) set to the same value in every
    block; the other bytes are random quants."""
    fixed: list[tuple[int, np.ndarray]]


def _layouts() -> dict[T, _Layout]:
    # std of uniform quants: 16 levels 4.61, 32 levels 9.23, 64 levels 18.47, int8 73.9
    q4k_sc = 32  # every sub-block's 6-bit scale and min; packed as llama.cpp's get_scale_min_k4 reads
    q4k_scales = np.array([160] * 8 + [0] * 4, dtype=np.uint8)  # 32 = 0b10_0000 for all 8 pairs
    d4 = STD / (q4k_sc * 4.61)
    d5 = STD / (q4k_sc * 9.23)
    q6_sc = 8
    return {
        T.Q8_0: _Layout([(0, _f16(STD / 73.9))]),
        T.Q4_0: _Layout([(0, _f16(STD / 4.61))]),
        T.Q4_1: _Layout([(0, _f16(STD / 4.61)), (2, _f16(-7.5 * STD / 4.61))]),  # d, m
        # d, dmin (w = d*sc*q - dmin*m: mean 0 with dmin*m = 7.5 d*sc), scales, quants
        T.Q4_K: _Layout([(0, _f16(d4)), (2, _f16(7.5 * d4)), (4, q4k_scales)]),
        T.Q5_K: _Layout([(0, _f16(d5)), (2, _f16(15.5 * d5)), (4, q4k_scales)]),
        # ql[128], qh[64], 16 int8 scales, d (w = d*sc*(q - 32))
        T.Q6_K: _Layout([(192, np.full(16, q6_sc, dtype=np.uint8)),
                         (208, _f16(STD / (q6_sc * 18.47)))]),
    }


_LAYOUTS = _layouts()


def _random_rows(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """rows of a [*, cols] tensor in qtype, as the bytes the file stores (uint8 [rows, *])."""
    if qtype == T.F32:
        return np.ones((rows, cols), dtype=np.float32).view(np.uint8)
    if qtype in (T.F16, T.BF16):
        values = rng.standard_normal((rows, cols), dtype=np.float32) * STD
        if qtype == T.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.frombuffer(rng.bytes(rows * cols // block * size), dtype=np.uint8)
    blocks = blocks.reshape(-1, size).copy()
    for offset, value in _LAYOUTS[qtype].fixed:
        blocks[:, offset:offset + len(value)] = value
    return blocks.reshape(rows, -1)


def _row_bytes(qtype: T, cols: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return cols // block * size


# ---- the model's tensors -------------------------------------------------------------------

@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: [(experts,) out, in]
    qtype: T
    values: Callable[[int, np.random.Generator], np.ndarray] | None = None  # F32 contents

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape[:-1]) * _row_bytes(self.qtype, self.shape[-1])


def _name(tensor: MT, bid: int | None = None) -> str:
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"


def llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray | None:
    """convert_hf_to_gguf.py's rope_freqs tensor for "llama3" rope scaling (None without)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    dim = config["head_dim"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def plan_tensors(config: dict[str, Any], arch: str, file_type: str) -> list[TensorPlan]:
    """Every tensor of the model in llama.cpp's order and names, with its type."""
    h, n = config["hidden_size"], config["num_hidden_layers"]
    hd, vocab = config["head_dim"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    tied = config.get("tie_word_embeddings", False)
    experts = config.get("num_experts", 0)

    def weight(tensor: MT, shape: tuple[int, ...], role: str, bid: int | None = None
               ) -> TensorPlan:
        qtype = tensor_type(file_type, role, bid or 0, n, tied, experts)
        if qtype not in (T.F16, T.BF16, T.F32) and shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            raise ValueError(f"{_name(tensor, bid)}: {shape[-1]} input features are not a "
                             f"multiple of {qtype.name}'s block (llama.cpp would fall back "
                             "to another type; not done here)")
        return TensorPlan(_name(tensor, bid), shape, qtype)

    def norm(tensor: MT, size: int, bid: int | None = None) -> TensorPlan:
        return TensorPlan(_name(tensor, bid), (1, size), T.F32)

    plans = [weight(MT.TOKEN_EMBD, (vocab, h), "token_embd")]
    freqs = llama3_rope_freqs(config)
    if freqs is not None:
        plans.append(TensorPlan(_name(MT.ROPE_FREQS), (1, len(freqs)), T.F32,
                                lambda rows, rng: freqs[None, :].view(np.uint8)))
    for i in range(n):
        plans += [norm(MT.ATTN_NORM, h, i), weight(MT.ATTN_Q, (q, h), "attn_q", i),
                  weight(MT.ATTN_K, (kv, h), "attn_k", i), weight(MT.ATTN_V, (kv, h), "attn_v", i),
                  weight(MT.ATTN_OUT, (h, q), "attn_output", i)]
        if arch in ("qwen3", "qwen3moe"):
            plans += [norm(MT.ATTN_Q_NORM, hd, i), norm(MT.ATTN_K_NORM, hd, i)]
        plans.append(norm(MT.FFN_NORM, h, i))
        if experts:
            ffn = config["moe_intermediate_size"]
            plans += [TensorPlan(_name(MT.FFN_GATE_INP, i), (experts, h), T.F32,
                                 lambda rows, rng: (rng.standard_normal((rows, h), np.float32)
                                                    * STD).view(np.uint8)),
                      weight(MT.FFN_GATE_EXP, (experts, ffn, h), "ffn_gate_exps", i),
                      weight(MT.FFN_UP_EXP, (experts, ffn, h), "ffn_up_exps", i),
                      weight(MT.FFN_DOWN_EXP, (experts, h, ffn), "ffn_down_exps", i)]
        else:
            ffn = config["intermediate_size"]
            plans += [weight(MT.FFN_GATE, (ffn, h), "ffn_gate", i),
                      weight(MT.FFN_UP, (ffn, h), "ffn_up", i),
                      weight(MT.FFN_DOWN, (h, ffn), "ffn_down", i)]
    plans.append(norm(MT.OUTPUT_NORM, h))
    if not tied:
        plans.append(weight(MT.OUTPUT, (vocab, h), "output"))
    return plans


def _chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    rows, cols = math.prod(plan.shape[:-1]), plan.shape[-1]
    if plan.values is not None:
        yield plan.values(rows, rng)
        return
    step = max(1, CHUNK_BYTES // max(1, _row_bytes(plan.qtype, cols)))
    for start in range(0, rows, step):
        yield _random_rows(plan.qtype, min(step, rows - start), cols, rng)


# ---- metadata and file -------------------------------------------------------------------

@functools.cache
def _bundled_tokenizer() -> dict[str, Any]:
    """The bundled SmolLM2 GGUF's tokenizer.* and chat template metadata (read once)."""
    meta = open_gguf(default_model_path()).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The bundled SmolLM2 GGUF's tokenizer, padded with unused tokens to vocab_size."""
    meta = _bundled_tokenizer()
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if vocab_size < len(tokens):
        raise ValueError(f"a vocabulary of {vocab_size} is smaller than the bundled "
                         f"tokenizer's {len(tokens)} tokens")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unknown", writer.add_unk_token_id),
                     ("padding", writer.add_pad_token_id)):
        if (value := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            add(value)
    if template := meta.get("tokenizer.chat_template"):
        writer.add_chat_template(template)


def _add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any], name: str,
                 file_type: str) -> None:
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("num_experts"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type(_FILE_TYPES[file_type][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_random_gguf(config_class: str, config: dict[str, Any], path: str | Path,
                      file_type: str, name: str = "random", seed: int = 0,
                      progress: bool = False) -> Path:
    """Write the model of a random_model preset (its config class and kwargs) as a GGUF file
    of file_type (one of GGUF_TYPES), streaming each tensor's blocks to disk."""
    if file_type not in _FILE_TYPES:
        raise ValueError(f"unknown GGUF type {file_type!r} (one of {', '.join(GGUF_TYPES)})")
    config = {"head_dim": config["hidden_size"] // config["num_attention_heads"], **config}
    arch = _ARCHS[config_class]
    plans = plan_tensors(config, arch, file_type)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    _add_hparams(writer, config, name, file_type)
    _add_tokenizer(writer, config["vocab_size"])
    for plan in plans:
        byte_shape = (*plan.shape[:-1], _row_bytes(plan.qtype, plan.shape[-1]))
        shape = plan.shape[1:] if plan.shape[0] == 1 else plan.shape  # norms are 1-D
        writer.add_tensor_info(plan.name, (*shape[:-1], byte_shape[-1]), np.dtype(np.uint8),
                               plan.nbytes, raw_dtype=plan.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    _write_data(path, plans, writer.data_alignment, seed, progress)
    return path


def _write_data(path: Path, plans: list[TensorPlan], alignment: int, seed: int,
                progress: bool) -> None:
    """The tensors' bytes after the header, each starting on the alignment (as GGUFWriter
    lays them out), written chunk by chunk."""
    from tqdm import tqdm
    rng = np.random.default_rng(seed)
    total = sum(p.nbytes for p in plans)
    with open(path, "ab") as f, tqdm(total=total, unit="B", unit_scale=True,
                                     desc=f"writing {path.name}", disable=not progress) as bar:
        for plan in plans:
            f.write(b"\0" * (-f.tell() % alignment))
            for chunk in _chunks(plan, rng):
                f.write(chunk.tobytes() if not chunk.flags.c_contiguous else chunk.data)
                bar.update(chunk.nbytes)
        f.write(b"\0" * (-f.tell() % alignment))
