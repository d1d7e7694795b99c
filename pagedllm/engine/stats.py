"""What the engine reports about itself: the last step, gauges for /metrics, KV-cache use
over time, and a snapshot of the paged KV cache for the web page."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.scheduler import Scheduler


@dataclass
class KVMemoryStats:
    """Samples of KV-cache use, taken after every EVERY-th step (each sample walks every
    block table, so not after every step unless check_invariants is on)."""

    EVERY = 8
    num_steps: int = 0
    num_samples: int = 0
    tokens_held: int = 0       # summed over samples
    slots_allocated: int = 0   # summed over samples
    peak_blocks: int = 0

    def step(self, scheduler: Scheduler, sample: bool = False) -> None:
        bm = scheduler.block_manager
        self.peak_blocks = max(self.peak_blocks, len(bm.used_block_ids))
        if sample or self.num_steps % self.EVERY == 0:
            held, slots = bm.kv_usage(list(scheduler.running))
            if slots:
                self.num_samples += 1
                self.tokens_held += held
                self.slots_allocated += slots
        self.num_steps += 1

    @property
    def waste(self) -> float:
        """Fraction of allocated KV slots holding no token, averaged over the samples."""
        return 1 - self.tokens_held / self.slots_allocated if self.slots_allocated else 0.0

    def report(self, scheduler: Scheduler) -> str:
        bm = scheduler.block_manager
        return (f"KV cache: {bm.num_blocks} blocks of {bm.block_size} tokens; peak "
                f"{self.peak_blocks} blocks used; over {self.num_samples} samples "
                f"{self.tokens_held} tokens held in {self.slots_allocated} slots allocated: "
                f"{self.waste:.1%} wasted in partly filled blocks; prefix-cache hit rate "
                f"{bm.hit_rate:.1%} ({bm.num_hit_tokens} of {bm.num_query_tokens} tokens); "
                f"{bm.num_copy_on_writes} copies on write; {scheduler.num_preemptions} preemptions")


@dataclass
class StepStats:
    """What the last step did, for progress bars, logs and metrics."""

    is_prefill: bool = False     # whether any prompt tokens were computed
    num_seqs: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    num_prefill_tokens: int = 0


@dataclass
class EngineStats:
    """Counters and gauges for /metrics, read on the engine's own thread."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_drafts: int = 0            # speculative decoding, lifetime: rows that verified drafts,
    num_draft_tokens: int = 0      # draft tokens verified
    num_accepted_tokens: int = 0   # and accepted


@dataclass
class KVCacheSnapshot:
    """Everything a picture of the paged KV cache needs, as plain data (JSON-ready)."""

    block_size: int
    ref_counts: list[int]          # per physical block; 0 = free
    cached: list[bool]             # per block: holds a prefix reusable by its hash
    requests: list[dict]           # running and waiting requests with their block tables
    stats: EngineStats
