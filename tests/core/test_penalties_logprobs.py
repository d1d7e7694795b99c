"""Sampler penalties and logprobs against a direct, loop-by-loop reference computation."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.engine.sequence import Sequence
from pagedllm.layers.sampler import (Penalties, SamplingBatch, apply_penalties, compute_logprobs,
                                     sample)
from pagedllm.sampling_params import SamplingParams

VOCAB = 12


def reference_penalised(logits: list[float], prompt: list[int], output: list[int],
                        rep: float, freq: float, pres: float) -> list[float]:
    """vLLM's penalties, one token at a time."""
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count
        if count:
            out[t] -= pres
    return out


def penalties_of(rows: list[tuple[list[int], list[int], float, float, float]],
                 vocab: int = VOCAB) -> Penalties:
    counts = torch.zeros(len(rows), vocab)
    mask = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for i, (prompt, output, *_) in enumerate(rows):
        for t in output:
            counts[i, t] += 1
        for t in prompt:
            mask[i, t] = True
    return Penalties(torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]),
                     torch.tensor([r[4] for r in rows]), counts, mask)


ROWS = [
    ([1, 2, 3], [3, 3, 5], 1.5, 0.0, 0.0),      # repetition only, prompt and output
    ([4], [6, 6, 6, 7], 1.0, 0.5, 0.0),         # frequency only
    ([4], [6, 6, 6, 7], 1.0, 0.0, 1.25),        # presence only
    ([0, 9], [9, 10, 10], 1.3, -0.4, 0.7),      # all three, negative frequency
    ([2], [], 1.0, 0.0, 0.0),                   # neutral row in the same batch
]


def test_penalties_match_the_reference():
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB) * 3
    got = apply_penalties(logits, penalties_of(ROWS))
    for i, (prompt, output, rep, freq, pres) in enumerate(ROWS):
        want = reference_penalised(logits[i].tolist(), prompt, output, rep, freq, pres)
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_greedy_sampling_applies_penalties_before_argmax():
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    counts = torch.tensor([[2.0, 0, 0], [0, 0, 0]])
    pen = Penalties(torch.ones(2), torch.tensor([1.0, 0.0]), torch.zeros(2), counts,
                    torch.zeros(2, 3, dtype=torch.bool))
    batch = SamplingBatch(torch.zeros(2), None, None, None, [], True, [], pen)
    # row 0: 5 - 2 * 1.0 = 3 < 4, so token 1 wins; row 1 has no penalty.
    assert sample(logits, batch, torch.Generator()).tolist() == [1, 0]


def reference_logprobs(logits: list[float], temperature: float) -> list[float]:
    t = temperature or 1.0
    z = [x / t for x in logits]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def test_logprobs_are_the_sampled_distribution_with_top_k_and_the_chosen_token():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3])
    batch = SamplingBatch(temps, None, None, None, [None] * 4, False, [(3, [0])],
                          num_logprobs=[3, None, 0, 5])
    tokens = torch.tensor([2, 4, 7, 1])
    got = compute_logprobs(logits.clone(), batch, tokens)
    assert got[1] is None
    for row, k in ((0, 3), (2, 0), (3, 5)):
        row_logits = logits[row].tolist()
        if row == 3:
            row_logits[0] = float("-inf")
        want = reference_logprobs(row_logits, float(temps[row]))
        lp = got[row]
        assert lp is not None and lp.token_id == tokens[row].item()
        assert lp.logprob == pytest.approx(want[tokens[row]], abs=1e-5)
        best = sorted(range(VOCAB), key=lambda t: -want[t])[:k]
        assert [t for t, _ in lp.top] == best
        assert [v for _, v in lp.top] == pytest.approx([want[t] for t in best], abs=1e-5)


def test_logprobs_see_the_penalties():
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    pen = penalties_of([([0], [1, 1], 2.0, 0.3, 0.1)], vocab=3)
    batch = SamplingBatch(torch.zeros(1), None, None, None, [], True, [], pen, [2])
    got = compute_logprobs(logits, batch, torch.tensor([0]))[0]
    want = reference_logprobs(reference_penalised([2.0, 1.0, 0.5], [0], [1, 1], 2.0, 0.3, 0.1), 0)
    assert got.logprob == pytest.approx(want[0], abs=1e-6)
    assert [v for _, v in got.top] == pytest.approx(sorted(want, reverse=True)[:2], abs=1e-6)


class _Runner:
    """Just enough of ModelRunner for prepare_sample (no model, no KV cache)."""

    from pagedllm.engine.model_runner import ModelRunner as _MR
    prepare_sample = _MR.prepare_sample
    prepare_penalties = _MR.prepare_penalties
    _upload = _MR._upload
    device = torch.device("cpu")

    class model_config:
        vocab_size = VOCAB


def test_prepare_sample_builds_penalties_only_when_a_request_uses_one():
    plain = Sequence([1, 2], SamplingParams(temperature=0), 4)
    pen = Sequence([1, 2], SamplingParams(temperature=0, frequency_penalty=0.5,
                                          repetition_penalty=1.2), 4)
    for t in (5, 5, 7):
        pen.append_token(t)
    runner = _Runner()
    assert runner.prepare_sample([plain, plain], []).penalties is None
    assert runner.prepare_sample([plain, plain], []).num_logprobs is None
    batch = runner.prepare_sample([plain, pen], [])
    p = batch.penalties
    assert p is not None
    assert p.output_counts[1].tolist() == [0, 0, 0, 0, 0, 2, 0, 1, 0, 0, 0, 0]
    assert p.prompt_mask[1].nonzero().flatten().tolist() == [1, 2]
    assert not p.output_counts[0].any() and not p.prompt_mask[0].any()
    assert p.repetition.tolist() == pytest.approx([1.0, 1.2])
    assert p.frequency.tolist() == [0.0, 0.5]
