"""EngineConfig: every engine knob in one validated place, shared by LLM(...) and the CLI."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.kernels import probes

CHECK_INVARIANTS_ENV = "PAGEDLLM_CHECK_INVARIANTS"
ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged", "triton", "flash")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Measured (scripts/spec_decode_standdown.py; docs/benchmarks.md, "Speculative decoding"):
# B random-token requests on the bundled SmolLM2 (Q4_1 weights, fp32 activations, 1 thread
# of a shared Zen 3), every row verifying d drafts that are all rejected, against plain
# decoding: d = 1 costs 1.24x at B = 1, 1.33x at 2, 1.37x at 4, 1.62x at 8, 1.38x at 16,
# 1.74x at 32 (d = 4: 1.75x .. 3.58x). A 1-token draft pays only when it is accepted more
# often than ratio - 1; from 8 rows on that was over half the time.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# A CUDA step's token budget with chunked prefill: large enough that a prompt step fills the
# GPU's matrix units (vLLM's default on such GPUs is 8192; nano-vllm's 16384), small enough
# that its activations leave the KV cache room (docs/benchmarks.md, "On an NVIDIA GPU").
GPU_MAX_NUM_BATCHED_TOKENS = 8192


def _opt(help: str, **kw: Any) -> Any:
    default = kw.pop("default")
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    """Engine options, named as in vLLM where vLLM has the option."""

    model: str | None = _opt("GGUF file or HF directory (default: the bundled SmolLM2-135M-Instruct)",
                             default=None, cli=False)
    dtype: str = _opt("weights and activations dtype: auto (bfloat16 where the CPU has native "
                      "bf16 matmuls, else float32; on CUDA bfloat16), float32, bfloat16, float16",
                      default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str | None = _opt(
        "gguf: compute from a GGUF file's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights as "
        "stored (their exact values, 4.5-8.5 bits a weight read per token instead of 16; "
        "bfloat16 activations; CPUs with AVX2 or AVX-512); none: dequantize every weight to "
        "--dtype. Default: gguf for GGUF files where it applies (CPU, one rank, --dtype "
        "auto), else none", default=None, choices=["gguf", "none"])
    max_model_len: int | None = _opt("longest prompt + output in tokens (default: the model's)",
                                     default=None)
    max_num_seqs: int = _opt("most sequences in one batch", default=256)
    max_num_batched_tokens: int | None = _opt(
        "token budget of one step (forward pass) (default with chunked prefill: 2048 on CPU, "
        f"{GPU_MAX_NUM_BATCHED_TOKENS} on CUDA; without: max(8192, max_model_len))", default=None)
    enable_chunked_prefill: bool = _opt(
        "split long prompts into chunks that share each step's token budget with running "
        "decodes", default=True)
    block_size: int = _opt("tokens per KV-cache block", default=16)
    kv_cache_dtype: str = _opt(
        "KV-cache element type: auto (the activations' dtype, but bfloat16 for GGUF weights "
        "kept quantized under float32 activations, as llama.cpp keeps an f16 cache), bfloat16 "
        "(under float32 activations on the CPU: half the KV memory and the bytes attention "
        "reads; K and V are rounded to bfloat16 once, as stored, in every path), float32, "
        "float16 (each only where the activations have it), int8 (CPU, float32 or bfloat16 "
        "activations: each token's head vector as 8-bit values and one fp32 scale, about half "
        "a bfloat16 cache's memory and bytes read; rounded once, as stored, in every path)",
        default="auto", choices=["auto", "bfloat16", "float32", "float16", "int8"])
    enable_prefix_caching: bool = _opt("share KV blocks of identical prompt prefixes", default=True)
    preemption_mode: str = _opt(
        "what a preempted sequence's KV becomes: recompute (freed, prefilled again) or swap "
        "(copied to --swap-space and back)", default="recompute", choices=["recompute", "swap"])
    swap_space: float = _opt("swap space in GiB for preemption_mode swap, summed over "
                             "tensor-parallel ranks (a memory-mapped file per rank when the KV "
                             "cache is on the CPU)", default=4.0)
    kv_cache_memory_bytes: int | None = _opt(
        "KV-cache budget in bytes, summed over tensor-parallel ranks "
        "(overrides --kv-cache-memory-fraction)", default=None)
    kv_cache_memory_fraction: float = _opt(
        "KV-cache budget on the CPU as a fraction of available RAM (shared by the ranks on "
        "one machine)", default=0.25)
    kv_cache_populate: bool = _opt(
        "on the CPU, commit the KV cache's memory at start (the kernel zeroes it: seconds per "
        "GB on some machines) instead of as its blocks are first written, so that the first "
        "requests pay no page faults; `pagedllm bench` sets it", default=False)
    gpu_memory_utilization: float = _opt(
        "on CUDA, the fraction of each GPU's memory the engine may use: weights, the peak "
        "activations of a profiled warm-up step at the full token budget, and the KV cache, "
        "which gets the rest (vLLM's option)", default=0.9)
    tensor_parallel_size: int = _opt(
        "tensor-parallel ranks: the engine spawns N-1 worker processes, or joins the group "
        "torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT describe", default=1)
    distributed_timeout_seconds: float = _opt(
        "a tensor-parallel collective or rendezvous waiting longer than this fails the engine",
        default=300.0)
    device: str = _opt("where the model runs: auto (CUDA if available), cpu, cuda",
                       default="auto", choices=["auto", "cpu", "cuda"])
    attention_backend: str = _opt(
        "attention kernels: auto (cpu_paged, else torch, on CPU; flash, else triton, on CUDA), "
        "torch (torch_native), cpu_paged (C++), triton, flash (flash-attn)", default="auto",
        choices=list(ATTENTION_BACKENDS))
    enforce_eager: bool = _opt(
        "run every step op by op through the model's forward: no CUDA graphs of decode steps, "
        "no one-call CPU decode stack (module hooks then fire on every step)", default=False)
    seed: int = _opt("seed of the sampler's shared random generator", default=0)
    num_threads: int | None = _opt(
        "torch intra-op threads per rank (default: the cores divided among the local ranks)",
        default=None)
    speculative_config: dict | str | None = _opt(
        'speculative decoding, vLLM\'s shape as JSON: {"method": "ngram", '
        '"num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4} proposes '
        "up to k tokens copied from where the last 1..4 tokens occurred before in the prompt or "
        'output; {"method": "suffix"} (keys suffix_decoding_max_tree_depth, '
        "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, "
        "suffix_decoding_min_token_prob) the most frequent continuation of the longest matching "
        'suffix in the request and in recent outputs; {"model": "draft.gguf"} k tokens from a '
        'smaller model sharing the tokenizer; {"method": "self", "num_draft_layers": N} from the '
        "target's own first N layers (docs/serving.md). Drafts are verified exactly in one forward "
        'pass; "adaptive": false keeps proposals at k tokens, "disable_by_batch_size": N (null: '
        f"never) stops drafting in steps with N or more decode rows (default "
        f"{DEFAULT_DISABLE_BY_BATCH_SIZE}). Default: off", default=None)
    check_invariants: bool | None = _opt(
        "verify KV block accounting before and after every step and stop the engine on a "
        f"violation; unset: on if ${CHECK_INVARIANTS_ENV}=1", default=None)

    def __post_init__(self) -> None:
        if self.check_invariants is None:
            self.check_invariants = env_flag(CHECK_INVARIANTS_ENV)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self._validate()

    def _validate(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype} is not supported: for an "
                             "8-bit KV cache use int8 (on the CPU: 8-bit values with a scale "
                             "per token and head, as llama.cpp's q8_0)")
        if self.kv_cache_dtype not in ("auto", "int8", *_DTYPES):
            raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_DTYPES)}, int8; "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "int8":
            if self.device == "cuda":
                raise ValueError("kv_cache_dtype=int8 runs on the CPU only (its kernels are "
                                 "the C++ CPU ones); on CUDA use auto")
            if self.dtype not in ("auto", "float32", "bfloat16"):
                raise ValueError(f"kv_cache_dtype=int8 takes float32 or bfloat16 activations, "
                                 f"got dtype={self.dtype}")
        elif self.dtype != "auto" and self.kv_cache_dtype != "auto":
            kv, act = _DTYPES[self.kv_cache_dtype], _DTYPES[self.dtype]
            if kv != act and not (kv == torch.bfloat16 and act == torch.float32
                                  and self.device in ("auto", "cpu")):
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype} with dtype={self.dtype} on "
                    f"{self.device}: the KV cache holds the activations' dtype (auto), or "
                    f"bfloat16 under float32 activations on the CPU")
        if self.quantization not in (None, "gguf", "none"):
            raise ValueError(f"quantization must be gguf or none, got {self.quantization!r}")
        if self.quantization == "gguf" and self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"quantization=gguf computes in bfloat16 or float32; dtype "
                             f"{self.dtype!r} cannot go with it")
        if self.quantization == "gguf" and self.device == "cuda":
            raise ValueError("quantization=gguf has a CPU kernel only (device cpu)")
        if self.quantization == "gguf" and self.tensor_parallel_size != 1:
            raise ValueError("quantization=gguf runs on one rank (tensor_parallel_size=1)")
        positive_int("max_model_len", allow_none=True)
        positive_int("max_num_seqs")
        positive_int("max_num_batched_tokens", allow_none=True)
        positive_int("block_size")
        positive_int("tensor_parallel_size")
        positive_int("num_threads", allow_none=True)
        positive_int("kv_cache_memory_bytes", allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory_fraction!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if (not isinstance(self.swap_space, (int, float)) or isinstance(self.swap_space, bool)
                or not 0 <= self.swap_space < 1024):
            raise ValueError(f"swap_space must be a number of GiB in [0, 1024), got {self.swap_space!r}")
        if not self.distributed_timeout_seconds > 0:
            raise ValueError("distributed_timeout_seconds must be > 0, "
                             f"got {self.distributed_timeout_seconds!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off: a whole prompt then "
                f"runs in one step")

    def resolve(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the model."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device "
                             f"(torch {torch.__version__}); use device='cpu'")
        if self.max_num_batched_tokens is None:
            chunked = GPU_MAX_NUM_BATCHED_TOKENS if self.device == "cuda" else 2048
            self.max_num_batched_tokens = (chunked if self.enable_chunked_prefill
                                           else max(8192, self.max_model_len))
        if self.dtype == "auto":  # concrete from here on: spawned ranks get the same dtype
            self.dtype = str(default_dtype(self.device)).removeprefix("torch.")
        if self.kv_cache_dtype == "auto":
            # a GGUF's weights kept quantized are approximate already; fp32 activations (CPUs
            # without native bf16) get a bf16 cache: half the bytes decode attention reads
            gguf_fp32 = self.quantization == "gguf" and self.dtype == "float32"
            self.kv_cache_dtype = "bfloat16" if gguf_fp32 else self.dtype
        self._validate()

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return default_dtype("cuda" if self.device == "cuda" else "cpu")
        return _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the KV cache holds: kv_cache_dtype, or the activations' dtype (auto)."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        if self.kv_cache_dtype == "int8":
            return torch.int8
        return _DTYPES[self.kv_cache_dtype]

    # ---- CLI ----------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     defaults: dict[str, Any] | None = None) -> None:
        """A flag per field; `defaults` overrides some fields' defaults (and their help)."""
        defaults = defaults or {}
        unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"defaults for fields EngineConfig does not have: {sorted(unknown)}")
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                continue
            flag = "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            help = f"{f.metadata['help']} (default: {default})"
            if f.type in ("bool", "bool | None", bool):
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=default, help=help)
                continue
            ftype = {"int": int, "int | None": int, "float": float, "str": str}.get(f.type, str)
            parser.add_argument(flag, dest=f.name, type=ftype, default=default, help=help,
                                choices=f.metadata.get("choices"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)}
        kwargs.update(overrides)
        return cls(**kwargs)


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "self")
DRAFT_METHODS = ("draft_model", "self")   # proposers that run a model (spec_decode/draft_model.py)
# Keys every method takes, and each method's own (vLLM's names where vLLM has the option).
_SPEC_COMMON_KEYS = ("method", "num_speculative_tokens", "adaptive", "disable_by_batch_size")
_SPEC_METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
    "draft_model": ("model", "num_draft_blocks"),
    "self": ("num_draft_layers", "num_draft_blocks"),
}


def parse_speculative_config(value: dict | str | None) -> dict | None:
    """The validated speculative_config with its defaults filled in (None: off). A string
    is JSON (the CLI's form)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    method = value.get("method", "draft_model" if "model" in value else None)
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config: method must be one of {list(SPECULATIVE_METHODS)}, "
                         f"got {method!r}")
    known = {*_SPEC_COMMON_KEYS, *_SPEC_METHOD_KEYS[method]}
    if unknown := sorted(set(value) - known):
        raise ValueError(f"speculative_config: unknown keys {unknown} for method {method!r}; "
                         f"known: {sorted(known)}")
    config = {"method": method, **_parse_control(value)}
    parse = {"ngram": _parse_ngram, "suffix": _parse_suffix}.get(method, _parse_draft)
    config.update(parse(value))
    return config


def _positive_int(config: dict, key: str) -> None:
    v = config[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"speculative_config: {key} must be a positive integer, got {v!r}")


def _parse_control(value: dict) -> dict:
    """adaptive (per-request proposal length from its acceptance; default on) and
    disable_by_batch_size (no drafts in a step with this many decode rows; null: never)."""
    config = {"adaptive": value.get("adaptive", True),
              "disable_by_batch_size": value.get("disable_by_batch_size",
                                                 DEFAULT_DISABLE_BY_BATCH_SIZE)}
    if not isinstance(config["adaptive"], bool):
        raise ValueError(f"speculative_config: adaptive must be true or false, "
                         f"got {config['adaptive']!r}")
    if config["disable_by_batch_size"] is not None:
        _positive_int(config, "disable_by_batch_size")
    return config


def _parse_ngram(value: dict) -> dict:
    config = {"num_speculative_tokens": value.get("num_speculative_tokens"),
              "prompt_lookup_min": value.get("prompt_lookup_min", 1),
              "prompt_lookup_max": value.get("prompt_lookup_max")}
    if config["prompt_lookup_max"] is None:
        config["prompt_lookup_max"] = max(4, config["prompt_lookup_min"])
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        _positive_int(config, key)
    if config["prompt_lookup_min"] > config["prompt_lookup_max"]:
        raise ValueError(f"speculative_config: prompt_lookup_min ({config['prompt_lookup_min']}) "
                         f"exceeds prompt_lookup_max ({config['prompt_lookup_max']})")
    return config


def _parse_suffix(value: dict) -> dict:
    """vLLM's defaults; num_speculative_tokens defaults to the tree depth, as there."""
    depth = value.get("suffix_decoding_max_tree_depth", 24)
    config = {"suffix_decoding_max_tree_depth": depth,
              "num_speculative_tokens": value.get("num_speculative_tokens", depth),
              "suffix_decoding_max_cached_requests":
                  value.get("suffix_decoding_max_cached_requests", 10000),
              "suffix_decoding_max_spec_factor": value.get("suffix_decoding_max_spec_factor", 1.0),
              "suffix_decoding_min_token_prob": value.get("suffix_decoding_min_token_prob", 0.1)}
    for key in ("suffix_decoding_max_tree_depth", "num_speculative_tokens"):
        _positive_int(config, key)
    if depth < 2:
        raise ValueError("speculative_config: suffix_decoding_max_tree_depth must be >= 2 (a "
                         f"matched token and one to propose), got {depth!r}")
    cached = config["suffix_decoding_max_cached_requests"]
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        raise ValueError("speculative_config: suffix_decoding_max_cached_requests must be an "
                         f"integer >= 0 (0: no global cache), got {cached!r}")
    factor = config["suffix_decoding_max_spec_factor"]
    if not _is_number(factor) or not factor > 0:
        raise ValueError("speculative_config: suffix_decoding_max_spec_factor must be a number "
                         f"> 0, got {factor!r}")
    prob = config["suffix_decoding_min_token_prob"]
    if not _is_number(prob) or not 0 <= prob <= 1:
        raise ValueError("speculative_config: suffix_decoding_min_token_prob must be a number "
                         f"in [0, 1], got {prob!r}")
    return config


def _parse_draft(value: dict) -> dict:
    """draft_model: {"model": GGUF file or HF directory sharing the target's tokenizer};
    self: {"num_draft_layers": N}, the target's first N layers + its final norm and LM head
    (N < the target's layers, checked when the model is loaded). Both take
    num_speculative_tokens and num_draft_blocks, the draft's own KV pool in blocks of
    block_size tokens (default: as many as the target's pool, so the draft can hold every
    token the target holds)."""
    method = value.get("method", "draft_model")
    needed = "model" if method == "draft_model" else "num_draft_layers"
    config = {"num_speculative_tokens": value.get("num_speculative_tokens"),
              needed: value.get(needed), "num_draft_blocks": value.get("num_draft_blocks")}
    _positive_int(config, "num_speculative_tokens")
    if config["num_draft_blocks"] is not None:
        _positive_int(config, "num_draft_blocks")
    if method == "self":
        _positive_int(config, "num_draft_layers")
    elif not isinstance(config["model"], str) or not config["model"]:
        raise ValueError("speculative_config: method draft_model needs \"model\", the path of "
                         f"a GGUF file or HF directory, got {config['model']!r}")
    return config


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def env_flag(name: str) -> bool:
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (unset = off)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}={value!r} is not a boolean (use 1 or 0)")


def default_dtype(device: str = "cpu") -> torch.dtype:
    """bfloat16 on CPUs with native bf16 matmuls (AVX512-BF16 or AMX), else float32.
    On CUDA bfloat16 where the GPU supports it, else float16.

    With native support bf16 measured faster here on every shape that matters (half the
    weight bytes per decode step, oneDNN's bf16 GEMMs for prefill); without it torch emulates
    bf16 and float32 is faster. float32 stays available (and is what the HF parity tests pin).
    """
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if probes.cpu_has_native_bf16() else torch.float32
