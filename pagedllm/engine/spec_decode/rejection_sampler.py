"""Verifying draft tokens against the target model (Leviathan et al., Chen et al. 2023).

The target's logits at positions 0..k of a verified row give its distributions p_0..p_k;
draft token x_j is checked against p_j. Greedy: accept while x_j is p_j's argmax. Sampling
with a deterministic draft (a point mass on x_j, as the n-gram proposer's): accept with
probability p_j(x_j), else draw from p_j with x_j's mass removed and renormalised; then
every emitted token is distributed exactly as p_j. If all k are accepted, one more token
is drawn from p_k, so a row yields 1..k+1 tokens.
"""
from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """Accepted draft tokens then the target's own next token. target_argmax has
    len(draft) + 1 entries."""
    out: list[int] = []
    for x, best in zip(draft, target_argmax):
        if x != best:
            break
        out.append(x)
    out.append(target_argmax[len(out)])
    return out


def verify_sampled(probs: torch.Tensor, draft: list[int],
                   generator: torch.Generator | None) -> list[int]:
    """Accepted draft tokens then one token drawn from the target. probs [len(draft) + 1, V]
    (fp32, rows sum to 1) are the target's distributions after temperature and filters."""
    out: list[int] = []
    uniforms = torch.rand(len(draft), generator=generator, device=probs.device).tolist()
    for j, (x, u) in enumerate(zip(draft, uniforms)):
        p = probs[j]
        if u < float(p[x]):
            out.append(x)
            continue
        residual = p.clone()
        residual[x] = 0
        if float(residual.sum()) <= 0:  # (p(x) was 1 up to rounding: x is the only choice)
            out.append(x)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out
