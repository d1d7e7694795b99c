"""The state a verified row's sampler sees at each of its positions.

A decode row verifying k drafts yields k + 1 distributions: position j is the next-token
distribution after the sequence's tokens and its first j drafts. Everything the sampler
derives from the sequence's output so far (penalty counts, the EOS ban of min_tokens, bad
words that are one token from complete, a grammar's mask) must see those j drafts as if
they had been sampled, so that each position is processed exactly as plain decoding would process that
step. DraftPosition is that view: it has the attributes the model runner's prepare_sample
reads from a Sequence.
"""
from __future__ import annotations

from typing import Any

from pagedllm.engine.sequence import Sequence, TokenView


class DraftPosition(TokenView):
    """seq as it would be after accepting its first j draft tokens (read-only)."""

    def __init__(self, seq: Sequence, j: int) -> None:
        self.seq = seq
        self.grammar: Any = seq.grammar  # (its masks per position: draft_token_masks)
        self.sampling_params = seq.sampling_params
        self.generator = seq.generator
        self.bad_words_token_ids = seq.bad_words_token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.token_ids = seq.token_ids + seq.spec_token_ids[:j]


def draft_positions(seq: Sequence) -> list[DraftPosition]:
    """The k + 1 positions of a row verifying k drafts."""
    return [DraftPosition(seq, j) for j in range(len(seq.spec_token_ids) + 1)]
