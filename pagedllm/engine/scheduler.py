"""Scheduler: one token budget per step (vLLM V1 style), decodes first, then prompt chunks.

Every step has max_num_batched_tokens to spend. Running sequences are served first, in
admission order: a decode costs one token, a partially computed prompt its next chunk.
What is left goes to waiting prompts, chunked when enable_chunked_prefill is on, so a long
prompt never stalls the running streams for more than one step's budget. Decodes and
chunks run in the same forward pass (a mixed batch). When blocks run out, the most recently
admitted running sequence is preempted (recompute: its blocks are freed and it is
prefilled again later).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What the next forward pass computes.

    Row i computes num_new_tokens[i] tokens of seqs[i], from its num_computed_tokens on;
    rows computing one token (decodes) come first. samplers lists (sequence, row) pairs:
    the sequence appends a token sampled from the logits of the row's last token. A row
    whose chunk does not finish its prompt samples nothing; a prompt of a request with
    n > 1 is sampled by all n sequences (its forks) from the same row.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samplers: list[tuple[Sequence, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_decodes(self) -> int:
        return sum(1 for n in self.num_new_tokens if n == 1)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n in self.num_new_tokens if n > 1)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        return [seq for seq, _ in self.samplers]


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: list[int],
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- scheduling -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Spend one step's token budget: running sequences first, then waiting prompts."""
        rows: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        budget, preempted = self._schedule_running(self.max_num_batched_tokens, rows, copies)
        if not preempted:  # blocks are short: admitting more would only preempt again
            self._schedule_waiting(budget, rows, copies)
        return self._make_batch(rows, copies)

    def _schedule_running(self, budget: int, rows: list[tuple[Sequence, int]],
                          copies: list[tuple[int, int]]) -> tuple[int, bool]:
        bm = self.block_manager
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate_slots(seq, n):
                # The most recently admitted sequence gives its blocks back.
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    return budget, preempted
            copies.extend(bm.allocate_slots(seq, n))
            rows.append((seq, n))
            budget -= n
            i += 1
        return budget, preempted

    def _schedule_waiting(self, budget: int, rows: list[tuple[Sequence, int]],
                          copies: list[tuple[int, int]]) -> None:
        bm = self.block_manager
        # Forks of running prompts join the running set when their prompt is computed.
        num_seqs = len(self.running) + sum(len(s.pending_forks) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if num_seqs + 1 + len(seq.pending_forks) > self.max_num_seqs:
                break
            remaining = len(seq) - bm.num_reusable_tokens(seq)
            n = min(remaining, budget) if self.enable_chunked_prefill else remaining
            if n > budget or not bm.can_allocate_slots(seq, n):
                break
            copies.extend(bm.allocate_slots(seq, n))
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            rows.append((seq, n))
            budget -= n
            num_seqs += 1 + len(seq.pending_forks)

    def _make_batch(self, rows: list[tuple[Sequence, int]],
                    copies: list[tuple[int, int]]) -> ScheduledBatch:
        rows.sort(key=lambda r: r[1] != 1)  # decodes first (stable)
        batch = ScheduledBatch(blocks_to_copy=copies)
        for row, (seq, n) in enumerate(rows):
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            if seq.num_computed_tokens + n == len(seq):  # the last chunk: sample
                batch.samplers.append((seq, row))
                for child in self._fork_pending(seq, n):
                    batch.samplers.append((child, row))
        return batch

    def _fork_pending(self, seq: Sequence, n: int) -> list[Sequence]:
        """Start the other samples of an n > 1 request: they share the prompt's blocks."""
        children, seq.pending_forks = seq.pending_forks, []
        for child in children:
            self.block_manager.fork(seq, child)
            child.num_computed_tokens = seq.num_computed_tokens + n  # after this step
            child.num_cached_tokens = seq.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return children

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it waits at the head of the queue and is recomputed."""
        logger.info("preempting request %s (%d tokens) to free KV blocks", seq.request_id, len(seq))
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # ---- after the step ---------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> None:
        """Advance each row's computed tokens, append each sampled token, finish what stops."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for (seq, _), token_id in zip(batch.samplers, token_ids):
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, *reason)

    def _stop_reason(self, seq: Sequence, token_id: int) -> tuple[str, int | None] | None:
        sp = seq.sampling_params
        if seq.num_completion_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
            if token_id in sp.stop_token_ids:
                return "stop", token_id
        if sp.max_tokens is not None and seq.num_completion_tokens >= sp.max_tokens:
            return "length", None
        if len(seq) >= self.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence (stop, length or abort) and free its blocks at once."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.deallocate(seq)
        for child in seq.pending_forks:  # samples that never started end with their parent
            child.status = SequenceStatus.FINISHED
            child.finish_reason, child.stop_reason = reason, stop_reason
        seq.pending_forks = []

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(list(self.running))
        for seq in self.waiting:
            if seq.block_table:
                raise AssertionError(f"waiting {seq} holds blocks")
