"""What the scheduler asks of a speculative proposer.

Once per step, before it spends the budget, the scheduler hands the proposer the decode
rows that may speculate, each with the most draft tokens it could verify (max_lens: what
max_tokens, max_model_len and the proposal length allow); the proposer answers with up to
that many tokens per row, [] where it has no guess. The scheduler may still trim a draft
(budget, KV blocks): a proposer must not assume its whole draft is verified. It learns what
was accepted from the sequence itself (its tokens) on the next call.

release(seq) is called when a sequence finishes, is aborted or loses its KV (preemption by
recompute or swap): a proposer with per-sequence state (a draft model's KV cache) drops it
there, one that learns from finished outputs (suffix lookup) records them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.engine.sequence import Sequence


class Proposer(ABC):
    num_speculative_tokens: int

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_lens: list[int]) -> list[list[int]]:
        """Draft tokens for each of seqs, at most max_lens[i] (>= 1) for row i."""

    def release(self, seq: Sequence) -> None:
        """seq finished or was preempted: forget (or learn from) it."""
