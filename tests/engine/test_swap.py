"""Swap preemption: a preempted sequence's KV goes to the swap pool (a memory-mapped file
on the CPU) and comes back without recomputation; outputs equal recompute and HF."""
from __future__ import annotations

import time

import pytest

from pagedllm import LLM, SamplingParams

# one long run under a tiny KV cache, three engines (about 20 s)
pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n", "The three primary colors are", "Q: What is 17 * 23?\nA:"]
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4   # SmolLM2 fp32, block_size 16


@pytest.fixture(scope="module")
def prompt_ids(hf_smollm_tokenizer):
    return [hf_smollm_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy_tokens, prompt_ids):
    return hf_greedy_tokens(prompt_ids, NEW_TOKENS)


def test_swap_preemption_equals_recompute_and_hf(prompt_ids, hf_greedy):
    # 12 blocks for 5 sequences of ~3 blocks each: preemption is certain.
    llm = LLM(dtype="float32", block_size=16, max_model_len=256, check_invariants=True,
              kv_cache_memory_bytes=12 * BLOCK_BYTES, preemption_mode="swap", swap_space=0.01)
    engine = llm.engine
    sched = engine.scheduler
    assert sched.block_manager.num_blocks == 12 and sched.swap_pool.num_blocks > 12
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    figures = {}
    outputs = {}
    # Same engine, both modes (one model load): only the scheduler's choice differs.
    for mode in ("recompute", "swap"):
        sched.preemption_mode = mode
        before_pre, before_swap = sched.num_preemptions, sched.num_swap_outs
        prompt_tokens_before = engine.num_prompt_tokens
        t = time.perf_counter()
        outs = llm.generate(prompt_ids, sp, use_tqdm=False)
        figures[mode] = (time.perf_counter() - t, sched.num_preemptions - before_pre,
                         engine.num_prompt_tokens - prompt_tokens_before)
        outputs[mode] = [o.token_ids for o in outs]
        assert sched.num_preemptions > before_pre, f"{mode}: the workload must force preemption"
        if mode == "swap":
            assert sched.num_swap_outs > before_swap
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert sched.swap_pool.num_free_blocks == sched.swap_pool.num_blocks
    for mode, (seconds, preemptions, prompt_tokens) in figures.items():
        print(f"\n{mode}: {seconds:.2f} s, {preemptions} preemptions, "
              f"{prompt_tokens} prompt tokens computed")
    assert outputs["swap"] == outputs["recompute"] == hf_greedy
    # Swapped sequences come back without recomputation: fewer prompt tokens computed.
    assert figures["swap"][2] < figures["recompute"][2]
