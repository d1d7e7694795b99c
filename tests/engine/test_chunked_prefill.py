"""Chunked prefill: prompts split over several steps, mixed with decodes, give HF's greedy
tokens; a chunk attends to everything computed before it (nano-vllm #212)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.attention.context import get_context, reset_context
from pagedllm.engine.sequence import Sequence

NEW_TOKENS = 12
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
    "wine making. Within fifty years presses were running in more than two hundred cities, "
    "and the price of books fell so far that students could own them. Scholars argue about "
    "how much the press changed the Reformation, science and the idea of an author, but few "
    "doubt that",
    "def merge_sort(values):\n    if len(values) <= 1:\n        return values\n    middle = "
    "len(values) // 2\n    left = merge_sort(values[:middle])\n    right = merge_sort(values"
    "[middle:])\n    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += 1\n"
    "        else:\n            merged.append(right[j])\n            j += 1\n",
    "Recipe for a simple tomato soup. Ingredients: two kilograms of ripe tomatoes, one onion, "
    "three cloves of garlic, olive oil, salt, pepper, a handful of basil and a litre of "
    "vegetable stock. Step one: chop the onion and the garlic and soften them in the oil. "
    "Step two:",
]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


@pytest.fixture(scope="module")
def long_prompts(hf_smollm_tokenizer):
    ids = [hf_smollm_tokenizer.encode(t) for t in TEXTS]
    assert all(len(p) > 60 for p in ids)
    return ids


@pytest.fixture(scope="module")
def hf_reference(hf_greedy_tokens, long_prompts):
    return hf_greedy_tokens(long_prompts, NEW_TOKENS)


def make_llm(budget: int, **kw) -> LLM:
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
               block_size=16, max_num_batched_tokens=budget, enable_chunked_prefill=True,
               check_invariants=True, **kw)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [32, 37], ids=["chunks-at-block-edges", "chunks-inside-blocks"])
def test_chunked_prefill_matches_hf_and_prefix_hits_before_a_chunk(budget, long_prompts,
                                                                   hf_reference):
    llm = make_llm(budget)
    steps = []
    engine = llm.engine
    for i, ids in enumerate(long_prompts):
        engine.add_request(str(i), ids, greedy())
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        steps.append(engine.last_step)
        assert engine.last_step.num_tokens <= budget
    assert [outs[str(i)] for i in range(len(long_prompts))] == hf_reference
    # prompts are several chunks long, and decodes shared steps with chunks
    assert max(len(p) for p in long_prompts) > 3 * budget
    assert any(s.is_prefill and s.num_tokens > s.num_prefill_tokens for s in steps), \
        "no step mixed decodes with a prompt chunk"
    assert_all_blocks_free(llm)
    # Again: the prompts' full blocks now come from the prefix cache, then chunks follow.
    again = llm.generate(long_prompts, greedy(), use_tqdm=False)
    assert all(o.metrics.num_cached_tokens >= 48 for o in again)
    assert [o.token_ids for o in again] == hf_reference
    assert_all_blocks_free(llm)
    # With the cache forgotten (LLM.reset_prefix_cache) the prompts are computed in full again.
    assert llm.reset_prefix_cache()
    fresh = llm.generate(long_prompts, greedy(), use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in fresh] == [0] * len(long_prompts)
    assert [o.token_ids for o in fresh] == hf_reference
    assert_all_blocks_free(llm)


def test_chunk_key_length_counts_cached_and_earlier_chunks(long_prompts):
    """nano-vllm #212: a chunk's keys are the cached prefix + earlier chunks + the chunk."""
    llm = make_llm(32)
    runner = llm.engine.model_runner
    ids = long_prompts[0][:70]
    seq = Sequence(ids, greedy(), 16)
    seq.block_table = [7, 3, 9, 1, 4]
    seq.num_computed_tokens = 40            # e.g. 32 cached + an 8-token first chunk
    decode = Sequence(ids[:20] + [5], greedy(), 16)
    decode.block_table = [2, 6]
    decode.num_computed_tokens = 20
    input_ids, positions = runner.prepare_inputs([decode, seq], [1, 25])
    ctx = get_context()
    try:
        assert ctx.is_prefill and ctx.num_decodes == 1
        assert ctx.seqlens_q == [1, 25] and ctx.seqlens_k == [21, 65]
        assert ctx.context_lens.tolist() == [21]
        assert positions.tolist() == [20, *range(40, 65)]
        assert input_ids.tolist() == [5, *ids[40:65]]
        expected = [6 * 16 + 4] + [seq.block_table[p // 16] * 16 + p % 16 for p in range(40, 65)]
        assert ctx.slot_mapping.tolist() == expected
    finally:
        reset_context()


@pytest.mark.slow
def test_unchunked_engine_gives_hf_tokens(long_prompts, hf_reference):
    """enable_chunked_prefill=False: whole prompts in one step, beside the running decodes."""
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
              block_size=16, enable_chunked_prefill=False, check_invariants=True)
    outs = llm.generate(long_prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference
    assert_all_blocks_free(llm)
