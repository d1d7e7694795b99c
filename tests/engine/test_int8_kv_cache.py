"""kv_cache_dtype="int8": each token's head vector as 8-bit values and an fp32 scale
(attention/kv_quant.py). The cache holds 0.53x a bf16 cache's bytes at head_dim 64 (1.88x
the blocks for a budget); greedy outputs stay close to an fp32 cache's and to HF's (vLLM's
top-5 rule), in fp32 and bf16, on the bundled model and on tiny random Llama and Qwen3
models at head_dim 64 and 128 (the AVX-512 kernels' sizes); prefix caching, chunked
prefill, preemption (recompute and swap), n > 1, beam search, speculative decoding and the
one-call decode stack do not change them: every path reads K/V as stored, once rounded.
(Kernels: tests/kernels/test_int8_kv_cache_kernels.py; the other families: their modules.)"""
from __future__ import annotations

import pytest
import torch

from engine_cache import bounded_engine_cache  # tests/ (pytest prepends the rootdir)
from family_harness import (Family, assert_int8_kv_close, build, hf_greedy, prompt_ids)
from pagedllm import LLM
# the bf16 cache's module: the same prompts, replies and closeness rule (tests/engine)
from test_kv_cache_dtype import (BUDGET, NEW_TOKENS, PROMPTS, assert_close_by_top5, greedy,
                                 token_ids)

BLOCK_BYTES = 16 * 2 * 30 * 3 * (64 + 4)   # one 16-token block of SmolLM2's int8 KV


@bounded_engine_cache(maxsize=2)
def engine(**kw) -> LLM:
    options = dict(dtype="float32", kv_cache_dtype="int8", kv_cache_memory_bytes=BUDGET,
                   max_model_len=512, check_invariants=True)
    options.update(kw)
    return LLM(**options)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return token_ids(engine())


def test_the_cache_holds_int8_and_more_blocks():
    ours = engine()
    runner = ours.engine.model_runner
    assert runner.kv_cache.dtype == torch.int8 and runner.kv_cache.shape[-1] == 68
    assert runner.kv_shape.block_bytes == BLOCK_BYTES
    assert runner.num_kvcache_blocks == BUDGET // BLOCK_BYTES  # 171, against bf16's 91


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_close_to_an_unquantized_cache(dtype):
    """At the first token where the two continuations differ, each side's token is among
    the other's top 5 there (vLLM's rule); most tokens agree exactly."""
    plain = LLM(dtype=dtype, kv_cache_memory_bytes=BUDGET, max_model_len=512)
    assert_close_by_top5(engine(dtype=dtype), plain)


@pytest.mark.parametrize("kw", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},                                  # chunked prompts
    {"kv_cache_memory_bytes": 8 * BLOCK_BYTES, "max_num_batched_tokens": 64},  # preempts
    {"kv_cache_memory_bytes": 8 * BLOCK_BYTES, "max_num_batched_tokens": 64,
     "preemption_mode": "swap", "swap_space": 0.01},
    {"enforce_eager": True},                                         # op by op
    {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'},
    # a draft of the first 8 layers with an int8 cache of its own
    {"speculative_config": '{"method": "self", "num_draft_layers": 8, "num_speculative_tokens": 3}'},
], ids=["no-prefix-caching", "chunked", "recompute", "swap", "eager", "ngram", "self-draft"])
def test_engine_paths_give_the_same_greedy_tokens(kw, reference):
    llm = engine(**kw)
    assert token_ids(llm) == reference
    if "kv_cache_memory_bytes" in kw:
        assert llm.engine.stats().num_preemptions > 0, "the KV budget must force preemption"


def test_a_cached_prefix_gives_the_tokens_of_the_whole_prompt(reference):
    """The second time round every prompt's full blocks come from the prefix cache (read as
    int8) and the rest is computed: the same tokens as computing it all."""
    llm = engine()
    token_ids(llm)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert any(o.metrics.num_cached_tokens for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference


def test_n_and_beam_search_share_int8_blocks(reference):
    """n = 2 greedy samples both equal the single reply; beams fork int8 blocks (copy on
    write) and the best beam of width 1 is the greedy reply."""
    llm = engine()
    outs = llm.generate(PROMPTS, greedy(n=2), use_tqdm=False)
    for out, ref in zip(outs, reference):
        assert [list(c.token_ids) for c in out.outputs] == [ref, ref]
    beams = llm.beam_search(PROMPTS[:2], beam_width=1, max_tokens=NEW_TOKENS, use_tqdm=False)
    assert [b.outputs[0].token_ids[:NEW_TOKENS] for b in beams] == reference[:2]
    wide = llm.beam_search(PROMPTS[:2], beam_width=3, max_tokens=8, use_tqdm=False)
    assert all(len(b.outputs[0].token_ids) == 8 for b in wide)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bf16_decode_stack_equals_the_op_by_op_forward():
    """bf16 activations over an int8 cache: the one-call decode stack (store and attention
    in C++) gives the op-by-op forward's tokens."""
    fast, eager = (token_ids(engine(dtype="bfloat16", enforce_eager=e)) for e in (False, True))
    assert fast == eager


# Llama and Qwen3 (q/k norms) at the AVX-512 kernels' head sizes
FAMILIES = {
    "llama-d64": Family("llama-d64", "LlamaForCausalLM", "LlamaConfig", "llama",
                        dict(tie_word_embeddings=True), sizes=dict(
                            hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            max_position_embeddings=512)),
    "qwen3-d128": Family("qwen3-d128", "Qwen3ForCausalLM", "Qwen3Config", "qwen3",
                         dict(tie_word_embeddings=False), sizes=dict(
                             hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                             max_position_embeddings=512)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_close_to_hf(family, tmp_path):
    pytest.importorskip("transformers")
    built = build(FAMILIES[family], tmp_path)
    prompts = prompt_ids(LLM(str(built.hf_dir), dtype="float32",
                             kv_cache_memory_bytes=4 * 2**20))
    assert_int8_kv_close(built, "hf", prompts, hf_greedy(built.hf, prompts))
    if family == "llama-d64":  # two real processes, each rank's KV heads in its own cache
        options = dict(dtype="float32", kv_cache_dtype="int8", kv_cache_memory_bytes=2**24)
        one = LLM(str(built.hf_dir), **options).generate(prompts, greedy(), use_tqdm=False)
        with LLM(str(built.hf_dir), tensor_parallel_size=2, **options) as llm:
            two = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_unsupported_settings_are_refused():
    with pytest.raises(ValueError, match="int8"):
        LLM(dtype="float32", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="int8"):
        LLM(dtype="float16", kv_cache_dtype="int8")
