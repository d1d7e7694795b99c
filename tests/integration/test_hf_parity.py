"""Greedy outputs equal HF transformers token for token (fp32), whatever the engine settings."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

NEW_TOKENS = 48

RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "import numpy as np\n\n# compute the mean of every column of a matrix\n",
    "北京是中国的首都，",
    "Q: What is 17 * 23?\nA:",
    "The three primary colors are",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "用中文介绍一下你自己。",
    "Write a Python function that reverses a string.",
    "Explain in one paragraph what a KV cache is.",
]


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in RAW_PROMPTS]
    for p in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}])
        ids.append(tok.encode(text, add_special_tokens=False))
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy_tokens, prompt_ids):
    """HF's greedy continuation of each prompt, one prompt at a time (no padding)."""
    return hf_greedy_tokens(prompt_ids, NEW_TOKENS)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_model_len=2048,
               check_invariants=True)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    # min_tokens bans EOS exactly as HF's min_new_tokens does, so every reply is n long
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.has_unfinished_requests()


def test_our_tokenizer_matches_hf(llm, hf_smollm_tokenizer, prompt_ids):
    for text, ids in zip(RAW_PROMPTS, prompt_ids):
        assert ids == hf_smollm_tokenizer.encode(text)


def test_greedy_matches_hf_in_one_batch(llm, prompt_ids, hf_greedy):
    outs = llm.generate(prompt_ids, greedy())
    for ids, out, ref in zip(prompt_ids, outs, hf_greedy):
        assert out.prompt_token_ids == ids
        assert out.token_ids == ref, f"prompt {ids[:8]}...: ours {out.token_ids} vs HF {ref}"
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_keep_outputs(llm, prompt_ids, hf_greedy):
    # The same prompts again: their full blocks are now served from the prefix cache.
    hits_before = llm.engine.scheduler.block_manager.num_hit_tokens
    outs = llm.generate(prompt_ids, greedy())
    assert llm.engine.scheduler.block_manager.num_hit_tokens > hits_before
    assert [o.token_ids for o in outs] == hf_greedy
    assert any(o.metrics.num_cached_tokens > 0 for o in outs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("settings", [
    dict(enable_prefix_caching=False),
    dict(block_size=256),
    dict(max_num_seqs=1),
    dict(max_num_seqs=64, block_size=16),
], ids=["no-prefix-cache", "block256", "max_num_seqs1", "max_num_seqs64"])
def test_engine_settings_never_change_greedy_outputs(settings, prompt_ids, hf_greedy):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_model_len=2048,
              check_invariants=True, **settings)
    outs = llm.generate(prompt_ids, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy
    assert_all_blocks_free(llm)


def test_preemption_under_a_tiny_kv_cache_keeps_outputs(prompt_ids, hf_greedy):
    # 40 blocks x 16 tokens = 640 token slots for ~12 sequences of ~60-100 tokens.
    llm = LLM(dtype="float32", block_size=16, max_model_len=512, check_invariants=True,
              kv_cache_memory_bytes=40 * 16 * 2 * 30 * 3 * 64 * 4)
    assert llm.engine.scheduler.block_manager.num_blocks == 40
    outs = llm.generate(prompt_ids, greedy(), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must force preemption"
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == hf_greedy
    assert_all_blocks_free(llm)
