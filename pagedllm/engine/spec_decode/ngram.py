"""N-gram (prompt-lookup) proposer: guess the next tokens by finding the sequence's own
last n tokens earlier in its prompt + output and copying what followed them there.

No model runs: the draft is a point mass on the copied tokens, which the rejection sampler
verifies exactly. It pays off where outputs repeat their input (edits of code, quotes,
extraction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from pagedllm.engine.sequence import Sequence


@dataclass(frozen=True)
class NgramProposer(Proposer):
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, seqs: list[Sequence], max_lens: list[int]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids, min(self.num_speculative_tokens, k),
                              self.prompt_lookup_min, self.prompt_lookup_max)
                for seq, k in zip(seqs, max_lens)]


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens,
    trying n from max_n down to min_n; [] when none occurs (or k < 1).

    The match must start before the suffix itself (an occurrence overlapping the suffix is
    fine: "a a a" proposes "a"), and at least one token must follow it.
    """
    size = len(token_ids)
    if k < 1:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = token_ids[size - n:]
        last = suffix[-1]
        # latest start i < size - n with token_ids[i:i + n] == suffix
        for i in range(size - n - 1, -1, -1):
            if token_ids[i + n - 1] == last and token_ids[i:i + n] == suffix:
                return token_ids[i + n:min(i + n + k, size)]
    return []
