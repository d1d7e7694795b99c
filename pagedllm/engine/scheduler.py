"""Scheduler: which sequences run in the next step, prefill first, decode with preemption."""
from __future__ import annotations

import logging
from collections import deque

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: list[int],
                 enable_prefix_caching: bool = True) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
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

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next batch: new prompts if any fit, else one decode step of the running."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new_tokens = len(seq) - bm.num_reusable_tokens(seq)
            if num_batched_tokens + num_new_tokens > self.max_num_batched_tokens:
                break
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            num_batched_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    # The most recently admitted sequence gives its blocks back.
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                bm.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it waits at the head of the queue and is recomputed."""
        logger.info("preempting request %s (%d tokens) to free KV blocks", seq.request_id, len(seq))
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # ---- after the step ---------------------------------------------------------------------

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Append each sampled token and finish the sequences that hit a stop condition."""
        for seq, token_id in zip(seqs, token_ids):
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
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.deallocate(seq)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(list(self.running))
        for seq in self.waiting:
            if seq.block_table:
                raise AssertionError(f"waiting {seq} holds blocks")
