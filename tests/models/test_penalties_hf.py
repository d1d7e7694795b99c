"""Repetition penalty and logprobs through the whole engine, against HF transformers (fp32)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

# loads HF transformers' SmolLM2 from the GGUF (about 12 s) as the reference
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
               check_invariants=True)


def test_greedy_with_repetition_penalty_equals_hf(llm, hf_smollm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                        repetition_penalty=1.3)
    # The plain greedy run of the same prompts shares the batch: penalties are per row.
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(PROMPTS + PROMPTS, [sp] * len(PROMPTS) + [plain] * len(PROMPTS),
                        use_tqdm=False)
    for prompt, out, plain_out in zip(PROMPTS, outs, outs[len(PROMPTS):]):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = hf_smollm.generate(torch.tensor([ids]), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     repetition_penalty=1.3, pad_token_id=2)
        assert out.token_ids == ref[0, len(ids):].tolist()
        assert out.token_ids != plain_out.token_ids, "the penalty must change this output"


def test_logprobs_equal_hf_log_softmax(llm, hf_smollm):
    tok = llm.get_tokenizer()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=3),
                       use_tqdm=False)[0]
    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == len(out.token_ids)
    ids = tok.encode(PROMPTS[0]) + out.token_ids
    with torch.inference_mode():
        ref = hf_smollm(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    n_prompt = len(ids) - len(out.token_ids)
    for i, lp in enumerate(out.outputs[0].logprobs):
        row = ref[n_prompt - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-3)
        top_values, top_ids = row.topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-3)
