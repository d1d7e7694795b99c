"""Scheduler: one token budget per step (vLLM V1 style), decodes first, then prompt chunks.

Every step has max_num_batched_tokens to spend. Running sequences are served first, in
admission order: a decode costs one token, a partially computed prompt its next chunk.
What is left goes to waiting prompts, chunked when enable_chunked_prefill is on, so a long
prompt never stalls the running streams for more than one step's budget. Decodes and
chunks run in the same forward pass (a mixed batch). When blocks run out, the most recently
admitted running sequence is preempted (recompute: its blocks are freed and it is
prefilled again later).

With speculative decoding a decode row may carry draft tokens (Sequence.spec_token_ids):
it costs 1 + k tokens of the budget, gets KV slots for all of them, and runs as a chunk of
1 + k query tokens; postprocess appends the accepted drafts and the target's next token,
then frees the rejected drafts' blocks. Rows whose sampling needs per-token state the
verifier does not replay decode one token at a time (_can_speculate).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.block_manager import FREED_BLOCK, BlockManager
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.spec_decode.control import SpeculationControl
from pagedllm.engine.spec_decode.proposer import Proposer
from pagedllm.engine.swap import SwapPool
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What the next forward pass computes.

    Row i computes num_new_tokens[i] tokens of seqs[i], from its num_computed_tokens on;
    rows computing one token (decodes) come first. samplers lists (sequence, row) pairs:
    the sequence appends a token sampled from the logits of the row's last token. A row
    whose chunk does not finish its prompt samples nothing; a prompt of a request with
    n > 1 is sampled by all n sequences (its forks) from the same row. A decode row that
    verifies draft tokens counts them in num_new_tokens (num_spec_tokens[i] of them, after
    the sequence's last token); its sequence appends 1 to num_spec_tokens[i] + 1 tokens.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_spec_tokens: list[int] = field(default_factory=list)
    samplers: list[tuple[Sequence, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Swap preemption: (device block, swap block) to copy out, (swap block, device block)
    # to copy back; out before in before copies, all before the forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in)

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
        return sum(n for n, k in zip(self.num_new_tokens, self.num_spec_tokens)
                   if n > 1 and not k)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        return [seq for seq, _ in self.samplers]


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: list[int],
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", num_swap_blocks: int = 0,
                 sliding_window: int | None = None,
                 proposer: Proposer | None = None,
                 spec_control: SpeculationControl | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          sliding_window)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        self.preemption_mode = preemption_mode
        self.swap_pool = SwapPool(num_swap_blocks)
        self._swap_out: list[tuple[int, int]] = []   # moves decided during this schedule()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.proposer = proposer
        # (None: every row that may speculate proposes num_speculative_tokens, every step)
        self.spec_control = spec_control or SpeculationControl(adaptive=False)
        self.num_drafts = 0            # speculative decoding, lifetime: rows verified,
        self.num_draft_tokens = 0      # draft tokens verified
        self.num_accepted_tokens = 0   # and accepted

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.swapped

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- scheduling -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Spend one step's token budget: running sequences first, then waiting prompts."""
        rows: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        self._swap_out = []
        budget, preempted = self._schedule_running(self.max_num_batched_tokens, rows, copies)
        if not preempted:  # blocks are short: admitting more would only preempt again
            budget = self._schedule_swapped(budget, rows, copies, swap_in)
            if not self.swapped:  # swapped sequences resume before new ones start
                self._schedule_waiting(budget, rows, copies)
        if not rows and self.waiting and self.running:
            self._make_room_for_waiting()
            self._schedule_waiting(budget, rows, copies)
        batch = self._make_batch(rows, copies)
        batch.blocks_to_swap_out, batch.blocks_to_swap_in = self._swap_out, swap_in
        return batch

    def _schedule_swapped(self, budget: int, rows: list[tuple[Sequence, int]],
                          copies: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Bring swapped sequences back, oldest first, while their blocks fit: the swapped
        ones, the ones their next chunk needs (a prompt swapped out mid-prefill may need
        several), and at least one to grow into."""
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            needed = cdiv(seq.num_computed_tokens + n, bm.block_size)
            if bm.num_free_blocks < max(needed, len(seq.swap_table) + 1):
                break
            self.swapped.popleft()
            table = bm.allocate_swapped_in(seq, len(seq.swap_table))
            swap_in.extend(zip(seq.swap_table, table))
            self.swap_pool.release(seq.swap_table)
            seq.swap_table = []
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if n:  # (0 for a beam waiting for the rest of its group)
                copies.extend(bm.allocate_slots(seq, n))
                rows.append((seq, n))
                budget -= n
        return budget

    def _make_room_for_waiting(self) -> None:
        """Nothing running can advance (beams wait for the rest of their group) and the
        waiting head does not fit: preempt running sequences to the back of the queue."""
        head = self.waiting[0]
        bm = self.block_manager
        while self.running and not bm.can_allocate_slots(
                head, len(head) - bm.num_reusable_tokens(head)):
            seq = self.running.pop()
            self.preempt(seq, to_front=False, allow_swap=False)

    def _schedule_running(self, budget: int, rows: list[tuple[Sequence, int]],
                          copies: list[tuple[int, int]]) -> tuple[int, bool]:
        bm = self.block_manager
        preempted = False
        proposals = self._propose(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens == 0:  # a beam waiting for the rest of its group
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = proposals.get(id(seq), [])[:budget - 1] if n == 1 else []
            if drafts and not bm.can_allocate_slots(seq, 1 + len(drafts)):
                drafts = []  # drafts never preempt anyone
            while not bm.can_allocate_slots(seq, n):
                # The most recently admitted sequence gives its blocks back.
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    return budget, preempted
            copies.extend(bm.allocate_slots(seq, n, len(drafts)))
            seq.spec_token_ids = drafts
            rows.append((seq, n + len(drafts)))
            budget -= n + len(drafts)
            i += 1
        return budget, preempted

    def _propose(self, budget: int) -> dict[int, list[int]]:
        """Draft tokens for the running decode rows that may speculate, by id(seq): as many
        as the proposer finds and the request can still append after its next token
        (max_tokens, max_model_len) and its recent acceptance allow; the caller trims them
        to the budget it has left. None at all when the step has so many decode rows that
        verifying drafts would cost more than it saves (SpeculationControl)."""
        if self.proposer is None:
            return {}
        control, k = self.spec_control, self.proposer.num_speculative_tokens
        decodes = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        if control.stands_down(len(decodes)):
            return {}
        seqs, max_lens = [], []
        for seq in decodes:
            if not _can_speculate(seq):
                continue
            room = min(budget - 1, self.max_model_len - len(seq) - 1,
                       control.proposal_len(seq, k))
            sp = seq.sampling_params
            if sp.max_tokens is not None:
                room = min(room, sp.max_tokens - seq.num_completion_tokens - 1)
            if room > 0:
                seqs.append(seq)
                max_lens.append(room)
        if not seqs:
            return {}
        return {id(seq): drafts for seq, drafts in zip(seqs, self.proposer.propose(seqs, max_lens))}

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
            k = len(seq.spec_token_ids)
            batch.num_spec_tokens.append(k)
            if seq.num_computed_tokens + n - k == len(seq):  # the last chunk: sample
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

    def preempt(self, seq: Sequence, to_front: bool = True, allow_swap: bool = True) -> None:
        """Free the sequence's blocks. With preemption_mode "swap" (and room in the swap
        pool) its KV is copied out and it resumes from there; otherwise it waits (at the
        head of the queue unless to_front is False) and is recomputed."""
        if seq in self.running:
            self.running.remove(seq)
        seq.spec_token_ids = []
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # (a sequence whose window freed blocks is recomputed: the swap pool moves whole tables)
        if (allow_swap and self.preemption_mode == "swap" and FREED_BLOCK not in seq.block_table
                and len(seq.block_table) <= self.swap_pool.num_free_blocks):
            self._swap_out_seq(seq)
            return
        logger.info("preempting request %s (%d tokens) to free KV blocks; it will be "
                    "recomputed", seq.request_id, len(seq))
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        if to_front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _swap_out_seq(self, seq: Sequence) -> None:
        logger.info("swapping out request %s (%d tokens, %d blocks)", seq.request_id, len(seq),
                    len(seq.block_table))
        table = self.block_manager.release_for_swap(seq)
        seq.swap_table = self.swap_pool.take(len(table))
        self._swap_out.extend(zip(table, seq.swap_table))
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)
        self.num_swap_outs += 1

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """Schedule a fork of parent (made by Sequence.fork): it shares parent's blocks, or
        waits beside it when parent was preempted."""
        self.block_manager.fork(parent, child)
        if parent.block_table:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            child.status = SequenceStatus.WAITING
            self.waiting.append(child)

    # ---- after the step ---------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int],
                    accepted: list[list[int]] | None = None) -> None:
        """Advance each row's computed tokens, append each sampled token, finish what stops.

        accepted[i] (speculative decoding) are the draft tokens of batch.samplers[i] that the
        verifier accepted: they are appended before token_ids[i], each checked for a stop as
        if it had been sampled alone; a stop drops the tokens after it.
        """
        for seq, n, k in zip(batch.seqs, batch.num_new_tokens, batch.num_spec_tokens):
            seq.num_computed_tokens += n - k
        for i, ((seq, _), token_id) in enumerate(zip(batch.samplers, token_ids)):
            if seq.is_beam:  # beams advance together, in the engine's beam step
                continue
            drafts = accepted[i] if accepted is not None else []
            num_proposed, start = len(seq.spec_token_ids), seq.num_computed_tokens - 1
            for t in (*drafts, token_id):
                seq.append_token(t)
                reason = self._stop_reason(seq, t)
                if reason is not None:
                    self.finish(seq, *reason)
                    break
            if num_proposed:
                self._commit_drafts(seq, start, num_proposed, len(drafts))

    def _commit_drafts(self, seq: Sequence, start: int, num_proposed: int,
                       num_accepted: int) -> None:
        """Count a verified row's drafts; the KV of the accepted ones is computed, the blocks
        holding only rejected ones are freed (a finished sequence freed all of its own)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        seq.num_drafts += 1
        seq.num_draft_tokens += num_proposed
        seq.num_accepted_tokens += num_accepted
        self.spec_control.record(seq, num_proposed, num_accepted)
        seq.spec_token_ids = []
        if not seq.is_finished:
            seq.num_computed_tokens += num_accepted
            self.block_manager.commit_speculation(seq, start)

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
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap_pool.release(seq.swap_table)
            seq.swap_table = []
        seq.status = SequenceStatus.FINISHED
        seq.spec_token_ids = []
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.deallocate(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        for child in seq.pending_forks:  # samples that never started end with their parent
            child.status = SequenceStatus.FINISHED
            child.finish_reason, child.stop_reason = reason, stop_reason
        seq.pending_forks = []

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(list(self.running))
        for seq in self.waiting:
            if seq.block_table:
                raise AssertionError(f"waiting {seq} holds blocks")
        swap_ids = [b for seq in self.swapped for b in seq.swap_table]
        for seq in self.swapped:
            if seq.block_table or len(seq.swap_table) * self.block_manager.block_size < \
                    seq.num_computed_tokens:
                raise AssertionError(f"swapped {seq} holds device blocks or too few swap blocks")
        if sorted(swap_ids + self.swap_pool.free_block_ids) != list(range(self.swap_pool.num_blocks)):
            raise AssertionError("swap pool: used + free blocks are not every block exactly once")


def _can_speculate(seq: Sequence) -> bool:
    """Whether a decode row may verify drafts. Penalties, logit controls, min_tokens,
    grammars and logprobs are replayed at every verified position (spec_decode/
    positions.py); beams (they advance together) and pooling rows, and a prompt whose other
    n samples are not forked yet, decode one token a step, in the same batch."""
    sp = seq.sampling_params
    return sp.pooling is None and not sp.use_beam_search and not seq.pending_forks
