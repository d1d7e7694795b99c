"""Counting the steps the one-call CPU decode stack (engine/cpu_decode_stack.py) runs, for
the tests that check which executor a step takes: counting_stack_steps(monkeypatch) wraps
CpuDecodeStack.run for the test."""
from __future__ import annotations

from pagedllm.engine.cpu_decode_stack import CpuDecodeStack


def counting_stack_steps(monkeypatch) -> dict[str, int]:
    """Counts of the steps CpuDecodeStack.run computes (returning hidden states):
    counts["stack"] all of them, counts["several"] those whose rows may have several new
    tokens (ctx.is_prefill: drafts being verified, short chunks over a cached prefix)."""
    counts = {"stack": 0, "several": 0}
    run = CpuDecodeStack.run

    def counting(self, input_ids, positions, ctx):
        out = run(self, input_ids, positions, ctx)
        counts["stack"] += out is not None
        counts["several"] += out is not None and ctx.is_prefill
        return out

    monkeypatch.setattr(CpuDecodeStack, "run", counting)
    return counts
