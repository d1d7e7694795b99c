"""The sampler: greedy, or temperature / top-k / top-p / min-p then Gumbel-max (seed 002).

Gumbel-max: argmax(p_i / E_i) with E_i ~ Exponential(1) draws i with probability p_i.
A request with a seed draws its noise from its own generator, so its samples do not
depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling options of one step, prepared by the ModelRunner."""

    temperatures: torch.Tensor            # [B] float32; 0 = greedy
    top_ks: torch.Tensor | None           # [B] int64, vocab size = disabled
    top_ps: torch.Tensor | None           # [B] float32, 1 = disabled
    min_ps: torch.Tensor | None           # [B] float32, 0 = disabled
    generators: list[torch.Generator | None]
    all_greedy: bool
    # (row, token ids) whose logits are forced to -inf, e.g. EOS before min_tokens
    banned: list[tuple[int, list[int]]]


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                            top_ps: torch.Tensor | None, min_ps: torch.Tensor | None
                            ) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's filters exclude. logits [B, V] already tempered."""
    if min_ps is not None:
        probs = logits.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * min_ps[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if top_ks is not None:
        kth = sorted_logits.gather(-1, (top_ks - 1).clamp(0, logits.shape[-1] - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p. The top token is always kept.
        mass_before = probs.cumsum(-1) - probs
        drop = mass_before >= top_ps[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                       default: torch.Generator) -> torch.Tensor:
    noise = torch.empty(shape)
    if all(g is None for g in generators):
        return noise.exponential_(generator=default)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen if gen is not None else default)
    return noise


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """Token ids [B] drawn from logits [B, V]."""
    logits = logits.float()
    for row, token_ids in batch.banned:
        logits[row, token_ids] = float("-inf")
    greedy_tokens = logits.argmax(-1)
    if batch.all_greedy:
        return greedy_tokens
    greedy = batch.temperatures == 0
    temps = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
    logits = apply_top_k_top_p_min_p(logits / temps[:, None], batch.top_ks, batch.top_ps,
                                     batch.min_ps)
    probs = logits.softmax(-1)
    noise = _exponential_noise(tuple(probs.shape), batch.generators, generator)
    sampled = (probs / noise.clamp_min_(1e-10)).argmax(-1)
    return torch.where(greedy, greedy_tokens, sampled)
