"""What every model family's tests share: a tiny random model built with transformers' own
class (every feature of the family on), saved as an HF directory and written as a GGUF
(tests/gguf_from_hf.py); prompts long enough to pass the windows and short contexts the
families set; HF's greedy replies; our engine's logits and replies under the settings
that must never change them (prefix caching, preemption, chunked prefill)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from gguf_from_hf import MetadataHook, quantize_weights, write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.attention.context import get_context, reset_context
from pagedllm.engine.sequence import Sequence
from pagedllm.loader import load_model_source

NEW_TOKENS = 32
# 8 prompts, 5 to ~70 tokens: the longer ones pass the tiny models' windows (8-16 tokens)
# and Phi-3's short context (48)
PROMPT_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning rowed out past the lighthouse and came back at noon with",
    "北京是中国的首都，上海是",
    "import numpy as np\n\n# compute the mean of every column of a matrix and print it "
    "rounded to two decimals, then the standard deviation of every row\n",
    "Q: What is 17 * 23?\nA:",
    "The library opens at nine in the morning and closes at six in the evening from Monday "
    "to Friday; on Saturday it closes at one. Members may borrow up to eight books for "
    "three weeks, and renew them twice unless",
    "A list of colours: red, green, blue, yellow, orange, purple, pink, brown, black, white,",
]


@dataclass
class Family:
    """A model family's tiny test model."""

    name: str
    hf_class: str                 # transformers class, e.g. "Qwen2ForCausalLM"
    config_class: str             # e.g. "Qwen2Config"
    gguf_arch: str                # llama.cpp's general.architecture
    config: dict[str, Any]        # config kwargs beyond the tiny sizes
    gguf_hook: MetadataHook | None = None
    gguf_transform: Callable[[str, Any], Any] | None = None
    init: Callable[[torch.nn.Module], None] | None = None  # weights away from HF's init
    # the GGUF type of each HF weight kept quantized in the GGUF (None: float32); the HF
    # model then holds their dequantized values (gguf_from_hf.quantize_weights)
    quantize: Callable[[str], Any] | None = None
    sizes: dict[str, Any] = field(default_factory=lambda: dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512))


@dataclass
class Built:
    family: Family
    hf: torch.nn.Module           # fp32, eval
    hf_dir: Path
    gguf: Path

    def path(self, fmt: str) -> str:
        return str(self.hf_dir if fmt == "hf" else self.gguf)


def _spread_norms(model: torch.nn.Module) -> None:
    """Norm weights away from their init so that the norms (and 1 + w variants) matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def build(family: Family, root: Path, tokenizer: Any = None) -> Built:
    """The family's tiny model, with `tokenizer` (pagedllm's Tokenizer; default the bundled
    model's, any would do)."""
    import transformers
    tokenizer = tokenizer or load_model_source(None).tokenizer
    hf_dir = root / family.name
    tokenizer.save_pretrained(str(hf_dir))
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(
        vocab_size=tokenizer.vocab_size, eos_token_id=2, bos_token_id=1,
        **{**family.sizes, **family.config})
    model = getattr(transformers, family.hf_class)(config).float().eval()
    _spread_norms(model)
    if family.init is not None:
        family.init(model)
    quantized = quantize_weights(model, family.quantize) if family.quantize else None
    model.save_pretrained(str(hf_dir))
    gguf = write_gguf(model, family.gguf_arch, root / f"{family.name}.gguf", family.gguf_hook,
                      family.gguf_transform, quantized)
    return Built(family, model, hf_dir, gguf)


def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPT_TEXTS]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]],
              new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """HF's greedy continuation of each prompt, one at a time (no padding)."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=2)
        out.append(seq[0, len(ids):].tolist())
    return out


def greedy(n: int = NEW_TOKENS, logprobs: int | None = None) -> SamplingParams:
    # min_tokens bans EOS exactly as HF's min_new_tokens does, so every reply is n long
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=logprobs)


def engine_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position, through our paged prefill path."""
    engine = llm.engine
    bm, runner = engine.scheduler.block_manager, engine.model_runner
    seq = Sequence(token_ids, SamplingParams(), engine.config.block_size)
    bm.allocate_slots(seq, len(seq) - bm.num_reusable_tokens(seq))
    try:
        with torch.inference_mode():
            input_ids, positions = runner.prepare_inputs([seq], [seq.num_uncomputed_tokens])
            assert get_context().is_prefill
            logits = runner.model.compute_logits(runner.model(input_ids, positions))
    finally:
        reset_context()
        bm.deallocate(seq)
    return logits


def kv_bytes_for_blocks(built: Built, blocks: int, block_size: int = 16,
                        dtype_bytes: int = 4) -> int:
    """kv_cache_memory_bytes that hold exactly `blocks` blocks of this model."""
    c = built.hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_block = 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * head_dim
    return blocks * per_block * dtype_bytes


# engine settings that must never change greedy outputs (fp32), by test id
SETTINGS: dict[str, Callable[[Built], dict[str, Any]]] = {
    "prefix-cache": lambda b: dict(enable_prefix_caching=True),
    "no-prefix-cache": lambda b: dict(enable_prefix_caching=False),
    # 24 blocks of 16 tokens for 8 sequences of up to ~100 tokens: some are preempted
    "preempt": lambda b: dict(kv_cache_memory_bytes=kv_bytes_for_blocks(b, 24),
                              max_model_len=256),
    # the same, preempted sequences swapped out to host memory and back (a sequence whose
    # window freed blocks is recomputed instead)
    "swap": lambda b: dict(kv_cache_memory_bytes=kv_bytes_for_blocks(b, 24), max_model_len=256,
                           preemption_mode="swap", swap_space=0.01),
    # 13-token chunks: their edges fall inside the 8-16 token windows
    "chunked": lambda b: dict(max_num_batched_tokens=13, max_num_seqs=4, max_model_len=256),
}


# the settings every family's greedy replies are checked under (the first in the fast tier)
SETTING_CASES = ["prefix-cache", *(pytest.param(name, marks=pytest.mark.slow)
                                   for name in SETTINGS if name != "prefix-cache")]
# (Built, the prompts' token ids, HF's greedy replies) of a family, by name
Case = tuple[Built, list[list[int]], list[list[int]]]


def models_fixture(families: dict[str, Family], root_name: str) -> Callable[..., Any]:
    """A module-scoped fixture `models`: models(name) builds the family's model once per
    module (on first use) and returns its Case."""
    @pytest.fixture(scope="module")
    def models(tmp_path_factory) -> Callable[[str], Case]:
        pytest.importorskip("transformers")
        root = tmp_path_factory.mktemp(root_name)
        cache: dict[str, Case] = {}

        def get(name: str) -> Case:
            if name not in cache:
                built = build(families[name], root)
                prompts = prompt_ids(LLM(str(built.hf_dir), dtype="float32",
                                         kv_cache_memory_bytes=4 * 2**20))
                cache[name] = built, prompts, hf_greedy(built.hf, prompts)
            return cache[name]

        return get

    return models


def assert_logits_match_hf(case: Case, fmt: str) -> None:
    """fp32 logits of every prompt position within 1e-4 of HF's."""
    built, prompts, _ = case
    llm = LLM(built.path(fmt), dtype="float32", kv_cache_memory_bytes=32 * 2**20)
    assert max_logit_error(llm, built.hf, prompts) < 1e-4


def assert_greedy_matches_hf(case: Case, fmt: str, setting: str) -> None:
    """fp32 greedy replies, all prompts in one generate call, equal HF's token for token."""
    built, prompts, reference = case
    _, outs = run_engine(built, fmt, setting, prompts)
    for ids, out, ref in zip(prompts, outs, reference):
        assert out.token_ids == ref, (f"{built.family.name} prompt {ids[:6]}...: "
                                      f"ours {out.token_ids} vs HF {ref}")


def run_engine(built: Built, fmt: str, setting: str, prompts: list[list[int]]) -> tuple[LLM, list]:
    options = dict(dtype="float32", kv_cache_memory_bytes=32 * 2**20, max_model_len=512,
                   check_invariants=True)
    options.update(SETTINGS[setting](built))
    llm = LLM(built.path(fmt), **options)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    if setting == "prefix-cache":  # again: the prompts' full blocks now come from the cache
        hits = llm.engine.scheduler.block_manager.num_hit_tokens
        again = llm.generate(prompts, greedy(), use_tqdm=False)
        assert llm.engine.scheduler.block_manager.num_hit_tokens > hits
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    # (an all-sliding model frees blocks as it goes: it may not need to be preempted)
    if setting in ("preempt", "swap") and not llm.engine.scheduler.block_manager.sliding_window:
        assert llm.engine.scheduler.num_preemptions > 0, "the setting must force preemption"
        if setting == "swap":
            assert llm.engine.scheduler.num_swap_outs > 0, "the setting must swap"
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return llm, outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_close_to_hf(hf: torch.nn.Module, prompts: list[list[int]], outs: list,
                       theirs: list[list[int]], name: str = "") -> None:
    """vLLM's closeness rule: at the first token where our greedy reply (outs, run with
    logprobs=5) and HF's (theirs, from the model hf) differ, each side's token is among the
    other's top-5."""
    for ids, out, ref in zip(prompts, outs, theirs):
        ours = out.token_ids
        i = first_difference(ours, ref)
        if i is None:
            continue
        our_top5 = {t for t, _ in out.outputs[0].logprobs[i].top}
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ref[:i]])).logits[0, -1].float()
        their_top5 = set(logits.topk(5).indices.tolist())
        assert ref[i] in our_top5 and ours[i] in their_top5, (
            f"{name} prompt {ids[:6]}...: token {i} ours {ours[i]} (top-5 {sorted(our_top5)}) "
            f"vs HF {ref[i]} (top-5 {sorted(their_top5)})")


def assert_bf16_close(built: Built, fmt: str, prompts: list[list[int]]) -> None:
    """vLLM's closeness rule for our bf16 greedy replies against HF's bf16 ones."""
    hf = type(built.hf).from_pretrained(str(built.hf_dir), dtype=torch.bfloat16).eval()
    theirs = hf_greedy(hf, prompts)
    llm = LLM(built.path(fmt), dtype="bfloat16", kv_cache_memory_bytes=32 * 2**20,
              max_model_len=512)
    outs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    assert_close_to_hf(hf, prompts, outs, theirs, built.family.name)


def assert_int8_kv_close(built: Built, fmt: str, prompts: list[list[int]],
                         reference: list[list[int]]) -> None:
    """An int8 KV cache under fp32 activations against HF's fp32 greedy replies (reference),
    by vLLM's closeness rule. Its features (windows, soft-caps, q/k norms, experts) all read
    the int8 cache."""
    llm = LLM(built.path(fmt), dtype="float32", kv_cache_dtype="int8",
              kv_cache_memory_bytes=32 * 2**20, max_model_len=512, check_invariants=True)
    assert llm.engine.model_runner.kv_cache.dtype == torch.int8
    outs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    assert_close_to_hf(built.hf, prompts, outs, reference, built.family.name)


def max_logit_error(llm: LLM, model: torch.nn.Module, prompts: list[list[int]]) -> float:
    err = 0.0
    for ids in prompts:
        ours = engine_logits(llm, ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        err = max(err, (ours.float() - ref).abs().max().item())
    assert math.isfinite(err)
    return err


def assert_tp2_equals_hf(built: Built, prompts: list[list[int]],
                         reference: list[list[int]]) -> None:
    """Two real processes over gloo (heads, biases, fused tensors, experts and the
    vocabulary split across them) give HF's greedy replies."""
    with LLM(str(built.hf_dir), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
             tensor_parallel_size=2, check_invariants=True) as llm:
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def assert_beam_search_equals_hf(built: Built, prompts: list[list[int]], width: int = 2,
                                 new_tokens: int = 16) -> None:
    """Beams fork and share blocks (windows too); the best equals transformers' beam search."""
    llm = LLM(str(built.hf_dir), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
              check_invariants=True)
    ours = llm.beam_search(prompts, beam_width=width, max_tokens=new_tokens, use_tqdm=False)
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            ref = built.hf.generate(torch.tensor([ids]), num_beams=width, do_sample=False,
                                    early_stopping=False, max_new_tokens=new_tokens,
                                    pad_token_id=2)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
