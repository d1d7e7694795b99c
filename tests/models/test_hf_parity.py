"""Greedy outputs equal HF transformers token for token (fp32), whatever the engine settings."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

# HF's greedy replies (one prompt at a time) and several engines (about 4 min)
pytestmark = pytest.mark.slow

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


SHARED_PREFIX = (
    "You are a careful assistant for a public library. Answer briefly and only with facts "
    "you are sure of. The library opens at nine in the morning and closes at six in the "
    "evening from Monday to Friday; on Saturday it closes at one. Members may borrow up "
    "to eight books for three weeks, and renew them twice unless another member has "
    "reserved them. Late returns cost ten cents a day per book. The reading room on the "
    "second floor is silent; group study rooms on the third floor can be booked for two "
    "hours at the front desk. Children under twelve must be accompanied by an adult after "
    "five. Printing costs five cents a page in black and white and twenty in colour. "
    "Lost cards are replaced for two dollars. The library's catalogue is searchable from "
    "any computer on the ground floor, and librarians can order books from partner "
    "libraries, which arrive within a week. Food is not allowed anywhere except the cafe "
    "next to the entrance, which sells coffee, tea and sandwiches until four. Bicycles "
    "are parked in the rack behind the building, never in the hall. Lockers on the ground "
    "floor take a coin that comes back when the key is returned. Wireless internet is free "
    "for members and visitors; the password is printed on the receipt of every loan. The "
    "library is closed on public holidays, and during the first week of August, when the "
    "shelves are cleaned and the collection is counted. Donations of books are welcome if "
    "they are clean and less than ten years old. Now go on "
    "with the text that follows.\n\n")


def test_a_long_shared_prefix_takes_cascade_attention_and_keeps_outputs(monkeypatch, llm,
                                                                         hf_greedy_tokens):
    """Prompts that share a ~300-token prefix: the first computes it, the others find it in
    the prefix cache (in the same step), and the decode steps attend to it once for all
    rows (cascade attention in the CPU backend). Outputs still equal HF's one by one."""
    from pagedllm.attention import cpu_paged
    calls = []
    real = cpu_paged.prefix_attention
    monkeypatch.setattr(cpu_paged, "prefix_attention",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    tok = llm.get_tokenizer()
    prompts = [tok.encode(SHARED_PREFIX + p) for p in RAW_PROMPTS]
    shared = len(tok.encode(SHARED_PREFIX)) - 1
    assert shared >= cpu_paged.CASCADE_MIN_TOKENS + llm.engine.config.block_size
    assert all(p[:shared] == prompts[0][:shared] for p in prompts)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert calls and max(calls) >= len(prompts), "the cascade path must run"
    assert all(o.metrics.num_cached_tokens >= 256 for o in outs[1:])
    assert [o.token_ids for o in outs] == hf_greedy_tokens(prompts, NEW_TOKENS)
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
