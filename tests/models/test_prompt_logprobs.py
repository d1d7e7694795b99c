"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log-softmax of
the same prompt (fp32): alone, in chunks, after the prefix cache holds the prompt, and
after a preemption recomputes it."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome. The capital of",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(out, hf, k: int) -> None:
    ids = out.prompt_token_ids
    ref = hf_prompt_logprobs(hf, ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        lp = out.prompt_logprobs[p]
        row = ref[p - 1]
        assert lp.token_id == ids[p]
        assert lp.logprob == pytest.approx(row[ids[p]].item(), abs=1e-4)
        values, top_ids = row.topk(k)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_equal_hf(hf_smollm, budget):
    kw = {} if budget is None else dict(max_num_batched_tokens=budget, enable_chunked_prefill=True)
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
              check_invariants=True, **kw)
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.generate(PROMPTS + PROMPTS, [sp, sp, plain, plain], use_tqdm=False)
    for out in outs[:2]:
        check(out, hf_smollm, 3)
    assert all(o.prompt_logprobs is None for o in outs[2:])
    # the sampled tokens are those of the same requests without prompt logprobs
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in outs[2:]]


def test_prompt_logprobs_after_a_prefix_cache_hit(hf_smollm):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
              enable_prefix_caching=True, check_invariants=True)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    # the prompts' blocks are cached now; a second request would hit them
    again = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    check(out, hf_smollm, 0)


def test_prompt_logprobs_survive_preemption(hf_smollm):
    # 6 blocks of 16 tokens: four long requests cannot all stay; recompute preempts some
    llm = LLM(dtype="float32", kv_cache_memory_bytes=6 * 737_280, max_model_len=128,
              max_num_seqs=4, preemption_mode="recompute", check_invariants=True)
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=40, prompt_logprobs=2)
    outs = llm.generate(PROMPTS * 2, sp, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test must preempt"
    for out in outs:
        check(out, hf_smollm, 2)
