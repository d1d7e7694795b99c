"""Block sharing between the sequences of one request.

Parallel sampling (n > 1): the prompt is computed once, the n samples share its blocks and
copy the partly filled last block on write; each sample equals the same seeded request alone.
Beam search: beams share their ancestors' blocks; the best hypothesis equals transformers'
generate(num_beams=k, do_sample=False, length_penalty=...)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

N = 4
GEN = 32
BS = 16
PROMPT = ("Four score and seven years ago our fathers brought forth on this continent, a new "
          "nation, conceived in Liberty, and dedicated to the proposition that all men are "
          "created equal. Now we are engaged in a great civil war, testing whether that nation")


@pytest.fixture(scope="module")
def llm():
    # Prefix caching off: whatever is shared here is shared by forking, not by hash hits.
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
               block_size=BS, enable_prefix_caching=False, check_invariants=True)


def sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, top_k=50, seed=seed, max_tokens=GEN,
                          min_tokens=GEN, ignore_eos=True)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_n_samples_share_the_prompt_blocks_and_equal_seeded_single_runs(llm):
    engine = llm.engine
    bm = engine.scheduler.block_manager
    prompt_ids = llm.get_tokenizer().encode(PROMPT)[:45]
    P = len(prompt_ids)
    assert P % BS, "the prompt's last block must be partly filled to exercise copy-on-write"
    cows_before = bm.num_copy_on_writes
    engine.add_request("n4", prompt_ids, sampled(seed=7, n=N))
    peak, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        peak = max(peak, len(bm.used_block_ids))
    assert out is not None and out.finished and len(out.outputs) == N
    assert [c.index for c in out.outputs] == list(range(N))
    assert all(len(c.token_ids) == GEN and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"

    # Blocks: the prompt's full blocks once, then per sample its own tail.
    shared_bound = P // BS + N * -(-(P % BS + GEN) // BS)
    unshared = N * -(-(P + GEN) // BS)
    print(f"\nn={N}, prompt {P} tokens, {GEN} generated each, block_size {BS}: peak KV blocks "
          f"{peak} with sharing vs {unshared} for {N} unshared copies "
          f"(prompt blocks {-(-P // BS)}, bound {shared_bound})")
    assert peak <= shared_bound < unshared
    assert bm.num_copy_on_writes - cows_before == N - 1   # the last holder writes in place
    assert_all_blocks_free(llm)

    # Sample i of a seeded request is the n = 1 request seeded with seed + i.
    alone = llm.generate([prompt_ids] * N, [sampled(seed=7 + i) for i in range(N)],
                         use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in alone]
    assert_all_blocks_free(llm)


def test_n_samples_through_generate_with_text_and_abort_frees_blocks(llm):
    outs = llm.generate(["The capital of France is", "Once upon a time"],
                        SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=8),
                        use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 3 and out.finished
        assert all(c.text == llm.get_tokenizer().decode(c.token_ids) or c.finish_reason == "stop"
                   for c in out.outputs)
    assert_all_blocks_free(llm)
    engine = llm.engine
    engine.add_request("abort-me", "Tell me a long story about a dragon.",
                       SamplingParams(n=4, temperature=1.0, max_tokens=64))
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("abort-me")
    assert aborted is not None and aborted.finished
    reasons = [c.finish_reason for c in aborted.outputs]
    assert "abort" in reasons and set(reasons) <= {"abort", "stop"}, reasons
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_n_larger_than_max_num_seqs_is_rejected(llm):
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.engine.add_request("too-many", "hi", SamplingParams(n=1000))


# ---- beam search -------------------------------------------------------------------------

BEAM_TOKENS = 16
BEAM_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def beam_prompt_ids(llm):
    return [llm.get_tokenizer().encode(p, add_special_tokens=False) for p in BEAM_PROMPTS]


def hf_beam_search(hf_model, ids: list[int], k: int, length_penalty: float) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), num_beams=k, do_sample=False,
                                length_penalty=length_penalty, early_stopping=False,
                                max_new_tokens=BEAM_TOKENS, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 0.6)])
def test_beam_search_matches_transformers(llm, hf_smollm, beam_prompt_ids, k, length_penalty):
    ours = llm.beam_search(beam_prompt_ids, beam_width=k, max_tokens=BEAM_TOKENS,
                           length_penalty=length_penalty, use_tqdm=False)
    for ids, out in zip(beam_prompt_ids, ours):
        ref = hf_beam_search(hf_smollm, ids, k, length_penalty)
        assert out.finished and len(out.outputs) == k
        scores = out.extra["beam_scores"]
        assert scores == sorted(scores, reverse=True)
        assert out.outputs[0].token_ids == ref, f"k={k} prompt {ids[:6]}: ours {out.outputs} vs HF {ref}"
    assert_all_blocks_free(llm)


def test_beams_share_blocks_and_dropped_beams_free_theirs(llm, beam_prompt_ids):
    engine = llm.engine
    bm = engine.scheduler.block_manager
    k, ids = 4, llm.get_tokenizer().encode(PROMPT)[:40]
    params = SamplingParams(n=k, temperature=0, max_tokens=BEAM_TOKENS, use_beam_search=True)
    engine.add_request("beams", ids, params)
    peak, cows_before = 0, bm.num_copy_on_writes
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(bm.used_block_ids))
    one_seq = -(-(len(ids) + BEAM_TOKENS) // BS)
    print(f"\nbeam search k={k}: peak {peak} physical blocks vs {k} x {one_seq} = "
          f"{k * one_seq} for unshared beams; {bm.num_copy_on_writes - cows_before} copies on write")
    assert peak < k * one_seq
    assert bm.num_copy_on_writes > cows_before
    assert_all_blocks_free(llm)
