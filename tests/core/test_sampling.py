"""SamplingParams validation and the sampler's filters and seeded reproducibility."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import SamplingBatch, apply_top_k_top_p_min_p, sample
from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(seed="x"), "seed"),
    (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_invalid_values_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _batch(n: int, temperature: float = 1.0, top_k=None, top_p=None, min_p=None, gens=None):
    return SamplingBatch(torch.full((n,), temperature), top_k, top_p, min_p,
                         gens if gens is not None else [None] * n, temperature == 0, [])


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    out = sample(logits, _batch(4, 0.0), torch.Generator().manual_seed(0))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert keep(apply_top_k_top_p_min_p(logits, torch.tensor([2]), None, None)) == [0, 1]
    assert keep(apply_top_k_top_p_min_p(logits, None, torch.tensor([0.8]), None)) == [0, 1]
    assert keep(apply_top_k_top_p_min_p(logits, None, torch.tensor([0.81]), None)) == [0, 1, 2]
    assert keep(apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.5]))) == [0, 1]
    assert keep(apply_top_k_top_p_min_p(logits, None, torch.tensor([0.01]), None)) == [0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(20000, 1)
    out = sample(logits, _batch(20000), torch.Generator().manual_seed(0))
    freq = torch.bincount(out, minlength=3).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_seeded_row_is_the_same_whatever_shares_its_batch():
    torch.manual_seed(0)
    row = torch.randn(1, 1000)

    def draw(batch_logits: torch.Tensor, row_index: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        gens = [None] * batch_logits.shape[0]
        gens[row_index] = gen
        shared = torch.Generator().manual_seed(99)
        return [sample(batch_logits, _batch(batch_logits.shape[0], gens=gens), shared)[row_index].item()
                for _ in range(20)]

    alone = draw(row, 0)
    crowded = draw(torch.cat([torch.randn(3, 1000), row, torch.randn(4, 1000)]), 3)
    assert alone == crowded
    assert len(set(alone)) > 1, "the draws must actually be random"


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(2, 5)
    logits[:, 2] = 100
    batch = _batch(2, 0.0)
    batch.banned = [(0, [2])]
    out = sample(logits, batch, torch.Generator())
    assert out[0].item() != 2 and out[1].item() == 2
