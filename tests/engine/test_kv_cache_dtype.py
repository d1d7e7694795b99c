"""kv_cache_dtype="bfloat16" under float32 activations (the bundled model in fp32; the
default for GGUF weights kept quantized under fp32 activations): the KV cache holds bf16 (twice the blocks for the same budget), greedy outputs stay close to the
fp32 cache's (vLLM's top-5 rule), and prefix caching, chunked prefill, preemption (recompute
and swap), speculative decoding and the one-call decode stack do not change them: every
path attends over K/V rounded to bf16 once, as stored. Mismatched settings are refused."""
from __future__ import annotations

import pytest
import torch

from engine_cache import bounded_engine_cache  # tests/ (pytest prepends the rootdir)
from pagedllm import LLM, SamplingParams

BUDGET = 32 * 2**20
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Copy the list exactly: red, green, blue, red, green, blue, red, green. Copy:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
NEW_TOKENS = 24
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 2   # one 16-token block of SmolLM2's bf16 KV


@bounded_engine_cache(maxsize=2)
def engine(**kw) -> LLM:
    options = dict(dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory_bytes=BUDGET,
                   max_model_len=512, check_invariants=True)
    options.update(kw)
    return LLM(**options)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def token_ids(llm: LLM, params: SamplingParams | None = None) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params or greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return token_ids(engine())


def test_the_cache_holds_bf16_and_twice_the_blocks():
    ours = engine()
    runner = ours.engine.model_runner
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert runner.kv_shape.block_bytes == BLOCK_BYTES
    fp32 = LLM(dtype="float32", kv_cache_memory_bytes=BUDGET, max_model_len=512)
    assert fp32.engine.model_runner.kv_cache.dtype == torch.float32
    assert runner.num_kvcache_blocks == BUDGET // BLOCK_BYTES              # 91
    assert fp32.engine.model_runner.num_kvcache_blocks == BUDGET // (2 * BLOCK_BYTES)  # 45


def test_greedy_outputs_close_to_the_fp32_caches(reference):
    """At the first token where the two continuations differ, each side's token is among
    the other's top 5 there (vLLM's rule); most tokens agree exactly."""
    fp32 = LLM(dtype="float32", kv_cache_memory_bytes=BUDGET, max_model_len=512)
    assert_close_by_top5(engine(), fp32)


def assert_close_by_top5(ours: LLM, theirs: LLM) -> None:
    """Both engines' greedy replies to PROMPTS: at the first token where they differ each
    side's token is among the other's top 5 there (vLLM's rule); at least half of all
    tokens come before a difference."""
    params = greedy(logprobs=5)
    agreed = 0
    for a, b in zip(ours.generate(PROMPTS, params, use_tqdm=False),
                    theirs.generate(PROMPTS, params, use_tqdm=False)):
        x, y = a.outputs[0], b.outputs[0]
        same = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t),
                    NEW_TOKENS)
        agreed += same
        if same < NEW_TOKENS:
            assert x.token_ids[same] in [t for t, _ in y.logprobs[same].top]
            assert y.token_ids[same] in [t for t, _ in x.logprobs[same].top]
    assert agreed >= len(PROMPTS) * NEW_TOKENS // 2, agreed


@pytest.mark.parametrize("kw", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},                                  # chunked prompts
    {"kv_cache_memory_bytes": 8 * BLOCK_BYTES, "max_num_batched_tokens": 64},  # preempts
    {"kv_cache_memory_bytes": 8 * BLOCK_BYTES, "max_num_batched_tokens": 64,
     "preemption_mode": "swap", "swap_space": 0.01},
    {"enforce_eager": True},                                         # op by op
    {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'},
], ids=["no-prefix-caching", "chunked", "recompute", "swap", "eager", "ngram"])
def test_engine_paths_give_the_same_greedy_tokens(kw, reference):
    llm = engine(**kw)
    assert token_ids(llm) == reference
    if "kv_cache_memory_bytes" in kw:
        assert llm.engine.stats().num_preemptions > 0, "the KV budget must force preemption"


def test_a_cached_prefix_gives_the_tokens_of_the_whole_prompt(reference):
    """The second time round every prompt's full blocks come from the prefix cache (read as
    bf16) and the rest is computed: the same tokens as computing it all."""
    llm = engine()
    token_ids(llm)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert any(o.metrics.num_cached_tokens for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference


def test_auto_gives_gguf_weights_kept_quantized_a_bf16_cache():
    """kv_cache_dtype auto: the activations' dtype, but bf16 under fp32 activations when the
    GGUF's weights are kept quantized (as llama.cpp's f16 cache); an HF-exact fp32 run
    (weights dequantized) keeps an fp32 cache."""
    options = dict(kv_cache_memory_bytes=2**22, max_model_len=256)
    kept = LLM(dtype="float32", quantization="gguf", **options)
    assert kept.engine.config.kv_cache_dtype == "bfloat16"
    assert kept.engine.model_runner.kv_cache.dtype == torch.bfloat16
    assert LLM(**options).engine.model_runner.kv_cache.dtype == torch.bfloat16  # (either way)
    dequantized = LLM(dtype="float32", **options)
    assert dequantized.engine.config.kv_cache_dtype == "float32"
    assert dequantized.engine.model_runner.kv_cache.dtype == torch.float32
    explicit = LLM(dtype="float32", quantization="gguf", kv_cache_dtype="float32", **options)
    assert explicit.engine.model_runner.kv_cache.dtype == torch.float32


def test_mismatched_settings_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(dtype="bfloat16", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(dtype="float32", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(dtype="float16", kv_cache_dtype="bfloat16")
