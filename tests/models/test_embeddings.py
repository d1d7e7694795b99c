"""Embeddings (LLM.embed, SamplingParams.pooling) against HF transformers' final hidden
states pooled the same way (fp32): last-token and mean pooling, in chunks, with the prefix
cached, and batched with generation."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who "
           "went out every morning before dawn.",
           "def add(a, b):\n    return a + b\n"]


def hf_embedding(hf, tokenizer, prompt: str, pooling: str) -> torch.Tensor:
    ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=0)


def assert_close(ours: list[float], ref: torch.Tensor) -> None:
    v = torch.tensor(ours)
    assert v.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(v, ref, dim=0).item() > 0.999999
    assert torch.allclose(v, ref, atol=1e-4)


@pytest.mark.parametrize("budget", [None, 16])
def test_last_and_mean_pooling_equal_hf(hf_smollm, budget):
    kw = {} if budget is None else dict(max_num_batched_tokens=budget, enable_chunked_prefill=True)
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
              check_invariants=True, **kw)
    tok = llm.get_tokenizer()
    for pooling in ("last", "mean"):
        for prompt, vector in zip(PROMPTS, llm.embed(PROMPTS, pooling=pooling, use_tqdm=False)):
            assert_close(vector, hf_embedding(hf_smollm, tok, prompt, pooling))
    raw = llm.embed(PROMPTS[:1], normalize=False, use_tqdm=False)[0]
    assert abs(sum(x * x for x in raw) - 1) > 1e-3  # not normalised when told not to


def test_embeddings_with_the_prefix_cached_and_beside_generation(hf_smollm):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
              enable_prefix_caching=True, check_invariants=True)
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    # the prompts are cached now; embeddings batched with the same generations again
    poolings = ("mean", "last", "last")
    embed = [SamplingParams(temperature=0, max_tokens=1, pooling={"pooling": p}) for p in poolings]
    outs = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + embed, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    assert all(o.embedding is None for o in outs[:3])
    for prompt, out, pooling in zip(PROMPTS, outs[3:], poolings):
        assert_close(out.embedding, hf_embedding(hf_smollm, tok, prompt, pooling))
    assert outs[4].metrics.num_cached_tokens > 0  # last pooling may take cached blocks
    mean = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1,
                                                   pooling={"pooling": "mean"}), use_tqdm=False)[0]
    assert mean.metrics.num_cached_tokens == 0  # mean pooling computes every token
    assert_close(mean.embedding, hf_embedding(hf_smollm, tok, PROMPTS[1], "mean"))


def test_bad_pooling_is_refused():
    with pytest.raises(ValueError, match="pooling must be"):
        SamplingParams(max_tokens=1, pooling={"pooling": "max"})
    with pytest.raises(ValueError, match="n = 1, max_tokens = 1"):
        SamplingParams(max_tokens=4, pooling={"pooling": "last"})
