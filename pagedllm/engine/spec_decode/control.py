"""How much to speculate: per request, from its recent acceptance; per step, from how many
rows already decode.

Adaptive proposal length: each sequence keeps an exponential average of accepted / proposed
over its verified steps (starting at 1: optimistic); it may propose up to
ceil(num_speculative_tokens * average) tokens, never fewer than 1. Rejected drafts shrink
its proposals, accepted ones let them grow back.

Stand-down: a verified row costs 1 + k tokens of the forward pass. With a few rows a decode
step is bound by reading the weights, and extra tokens ride along almost free; with many
rows the step is bound by compute and every rejected draft token costs about as much as a
real one. So when a step already has disable_by_batch_size decode rows or more, no row
proposes (vLLM V0's speculative_disable_by_batch_size).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.engine.sequence import Sequence

# Weight of the newest verified step in a sequence's acceptance average.
ACCEPTANCE_SMOOTHING = 0.5


@dataclass(frozen=True)
class SpeculationControl:
    adaptive: bool = True
    disable_by_batch_size: int | None = None   # None: never stand down

    def stands_down(self, num_decode_rows: int) -> bool:
        return (self.disable_by_batch_size is not None
                and num_decode_rows >= self.disable_by_batch_size)

    def proposal_len(self, seq: Sequence, num_speculative_tokens: int) -> int:
        if not self.adaptive:
            return num_speculative_tokens
        return max(1, math.ceil(num_speculative_tokens * seq.spec_acceptance - 1e-9))

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verified step of seq: num_accepted of its num_proposed drafts were accepted."""
        if num_proposed:
            seq.spec_acceptance += ACCEPTANCE_SMOOTHING * (num_accepted / num_proposed
                                                           - seq.spec_acceptance)
