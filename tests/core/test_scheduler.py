"""Scheduler: one token budget per step (decodes first, then prompt chunks), preemption of
the newest, limits, n > 1 forks, and invariants."""
from __future__ import annotations

import random

from hypothesis import example, given, settings, strategies as st

from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams

BS = 4
EOS = 0


def make_scheduler(num_blocks: int = 16, max_num_seqs: int = 8, max_tokens: int = 64,
                   max_model_len: int = 64, chunked: bool = True, preemption_mode: str = "recompute",
                   num_swap_blocks: int = 0) -> Scheduler:
    return Scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_tokens, max_model_len=max_model_len,
                     eos_token_ids=[EOS], enable_chunked_prefill=chunked,
                     preemption_mode=preemption_mode, num_swap_blocks=num_swap_blocks)


def make_seq(n: int, max_tokens: int = 8, first: int = 1) -> Sequence:
    return Sequence(list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), BS)


def rows(batch) -> list[tuple[Sequence, int]]:
    return list(zip(batch.seqs, batch.num_new_tokens))


def test_unchunked_prompts_wait_for_room_in_the_token_budget():
    s = make_scheduler(max_tokens=10, chunked=False)
    a, b, c = make_seq(6), make_seq(5, first=100), make_seq(3, first=200)
    for seq in (a, b, c):
        s.add(seq)
    batch = s.schedule()
    assert rows(batch) == [(a, 6)]              # a + b = 11 tokens > budget of 10
    s.postprocess(batch, [7])
    batch = s.schedule()
    assert rows(batch) == [(a, 1), (b, 5), (c, 3)]  # a's decode first, in the same step
    s.postprocess(batch, [7, 7, 7])
    batch = s.schedule()
    assert rows(batch) == [(a, 1), (b, 1), (c, 1)]


def test_chunked_prefill_fills_the_budget_after_decodes_and_samples_only_last_chunk():
    s = make_scheduler(max_tokens=8)
    a, b = make_seq(3), make_seq(17, first=100)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert rows(batch) == [(a, 3), (b, 5)]      # b's first chunk takes the rest of the budget
    assert batch.sampled_seqs == [a]            # no sampling for a non-final chunk
    s.postprocess(batch, [7])
    assert b.num_computed_tokens == 5 and len(b) == 17
    batch = s.schedule()
    assert rows(batch) == [(a, 1), (b, 7)]      # decode first, then the next chunk
    assert batch.sampled_seqs == [a]
    s.postprocess(batch, [7])
    batch = s.schedule()
    assert rows(batch) == [(a, 1), (b, 5)] and batch.sampled_seqs == [a, b]
    assert [row for _, row in batch.samplers] == [0, 1]
    s.postprocess(batch, [7, 7])
    assert b.num_computed_tokens == 17 and len(b) == 18
    s.check_invariants()


def test_n_samples_fork_from_the_last_chunk_and_share_its_blocks():
    s = make_scheduler(max_tokens=4)
    parent = make_seq(6)
    children = [make_seq(6), make_seq(6)]
    parent.pending_forks = children
    s.add(parent)
    batch = s.schedule()
    assert rows(batch) == [(parent, 4)] and batch.sampled_seqs == []
    s.postprocess(batch, [])
    batch = s.schedule()
    assert rows(batch) == [(parent, 2)]
    assert batch.sampled_seqs == [parent, *children]          # all from row 0
    assert all(row == 0 for _, row in batch.samplers)
    assert all(c.block_table == parent.block_table for c in children)
    s.postprocess(batch, [7, 8, 9])
    assert [c.last_token for c in children] == [8, 9]
    s.check_invariants()
    batch = s.schedule()                        # each writes its token into the shared block
    assert len(batch.blocks_to_copy) == 2       # two copies; the last holder writes in place
    assert len({seq.block_table[1] for seq in [parent, *children]}) == 3
    s.postprocess(batch, [1, 1, 1])
    s.check_invariants()


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, first=10 * i + 1) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    batch = s.schedule()
    assert batch.seqs == seqs[:2] and len(s.waiting) == 1


def test_preemption_picks_most_recently_admitted_and_it_resumes_first():
    s = make_scheduler(num_blocks=4)
    a, b = make_seq(4, max_tokens=20), make_seq(4, max_tokens=20, first=50)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.postprocess(batch, [9, 9])                  # each now 5 tokens: needs a 2nd block
    batch = s.schedule()
    assert rows(batch) == [(a, 1), (b, 1)]        # two blocks were free: both got their second
    for _ in range(4):
        s.postprocess(batch, [9] * len(batch))
        batch = s.schedule()
    # a and b each reached 9 tokens and need a third block: only b, the newest, is preempted
    assert b.status == SequenceStatus.WAITING and s.waiting[0] is b
    assert a.status == SequenceStatus.RUNNING and b.block_table == []
    assert s.num_preemptions >= 1
    s.check_invariants()


def test_stop_conditions():
    s = make_scheduler()
    eos = Sequence([1, 2], SamplingParams(max_tokens=10), BS)
    ignore = Sequence([1, 2], SamplingParams(max_tokens=10, ignore_eos=True), BS)
    stop_id = Sequence([1, 2], SamplingParams(max_tokens=10, stop_token_ids=[5]), BS)
    min_tok = Sequence([1, 2], SamplingParams(max_tokens=10, min_tokens=2), BS)
    for seq in (eos, ignore, stop_id, min_tok):
        s.add(seq)
    batch = s.schedule()
    s.postprocess(batch, [EOS, EOS, 5, EOS])
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert not ignore.is_finished
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason == 5
    assert not min_tok.is_finished
    assert eos.block_table == [] and stop_id.block_table == []


def test_max_tokens_and_max_model_len_end_with_length():
    s = make_scheduler(max_model_len=6)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=2), BS)
    b = Sequence([4, 5, 6, 7], SamplingParams(max_tokens=50), BS)
    s.add(a)
    s.add(b)
    for _ in range(3):
        batch = s.schedule()
        if not batch:
            break
        s.postprocess(batch, [9] * len(batch))
    assert a.finish_reason == "length" and a.num_completion_tokens == 2
    assert b.finish_reason == "length" and len(b) == 6
    assert s.is_finished()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(3, 24), st.integers(1, 6), st.booleans(),
       st.sampled_from([3, 7, 48]), st.integers(1, 3), st.sampled_from([0, 5, 64]))
# Found by CI: a prompt swapped out mid-prefill came back needing more blocks than its
# swapped ones + 1 for its next chunk, and allocation ran out of free blocks.
@example(seed=5, num_blocks=7, max_num_seqs=2, abort=False, budget=7, num_samples=1,
         swap_blocks=5)
def test_random_workloads_keep_invariants_and_free_everything(seed, num_blocks, max_num_seqs, abort,
                                                              budget, num_samples, swap_blocks):
    """Chunked prefill (budgets 3 and 7 split prompts, 48 does not), n > 1 forks with
    copy-on-write, preemption by recompute or swap (a pool of 5 blocks often too small:
    then recompute), aborts: the accounting holds after every step."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_tokens=budget,
                       max_model_len=48, preemption_mode="swap" if swap_blocks else "recompute",
                       num_swap_blocks=swap_blocks)
    seqs = []
    for i in range(rng.randint(1, 10)):
        # a few shared prefixes to exercise the prefix cache
        prefix = [1, 2, 3, 4, 5, 6, 7, 8][:rng.choice([0, 4, 8])]
        n = rng.randint(1, 12)
        total = min(48, len(prefix) + n + 6)
        if -(-total // BS) > num_blocks:
            continue  # the engine rejects such a request up front
        tokens = prefix + [rng.randint(1, 20) for _ in range(n)]
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        group = [Sequence(tokens, sp, BS) for _ in range(rng.choice([1, min(num_samples, max_num_seqs)]))]
        group[0].pending_forks = group[1:]
        seqs.extend(group)
        s.add(group[0])
    for _ in range(500):
        if s.is_finished():
            break
        batch = s.schedule()
        assert batch, "the scheduler must always make progress"
        assert len(batch) <= max_num_seqs and batch.num_tokens <= budget
        s.postprocess(batch, [rng.randint(1, 20) for _ in batch.samplers])
        if abort and rng.random() < 0.1:
            live = [q for q in seqs if not q.is_finished]
            if live:
                s.finish(rng.choice(live), "abort")
        s.check_invariants()
    assert s.is_finished()
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert s.swap_pool.num_free_blocks == swap_blocks
    for seq in seqs:
        assert seq.finish_reason in ("length", "abort")


def test_prefix_hit_after_preemption_resumes_correctly():
    """nano-vllm #211: a preempted sequence whose blocks are still cached is re-admitted
    with a prefix hit, computes only what is missing, and its block table stays consistent."""
    s = make_scheduler(num_blocks=6)
    a = Sequence(list(range(1, 9)), SamplingParams(max_tokens=30, ignore_eos=True), BS)
    b = Sequence(list(range(50, 58)), SamplingParams(max_tokens=30, ignore_eos=True), BS)
    s.add(a)
    s.add(b)
    batch = s.schedule()                          # 2 + 2 blocks
    s.postprocess(batch, [9, 9])
    while b.status != SequenceStatus.WAITING:     # grow until b is preempted
        batch = s.schedule()
        s.postprocess(batch, [9] * len(batch.samplers))
    s.check_invariants()
    b_len = len(b)
    # b's full blocks were freed but keep their hashes: they are found again
    assert s.block_manager.num_reusable_tokens(b) > 0
    s.finish(a, "abort")                          # room for b to come back
    batch = s.schedule()
    assert rows(batch) == [(b, b_len - b.num_cached_tokens)]
    assert b.num_cached_tokens > 0 and b.num_cached_tokens <= b_len - 1
    s.check_invariants()
    s.postprocess(batch, [9])
    batch = s.schedule()
    assert rows(batch) == [(b, 1)]
    s.check_invariants()


def test_swap_preemption_keeps_computed_tokens_and_moves_blocks_both_ways():
    s = make_scheduler(num_blocks=4, preemption_mode="swap", num_swap_blocks=8)
    a, b = make_seq(4, max_tokens=20), make_seq(4, max_tokens=20, first=50)
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [9, 9])
    s.postprocess(s.schedule(), [9, 9])           # 6 tokens each: 2 blocks each, cache full
    for _ in range(3):
        s.postprocess(s.schedule(), [9, 9])
    batch = s.schedule()                          # 9th token: b (newest) is swapped out
    assert b.status == SequenceStatus.SWAPPED and b.block_table == [] and len(b.swap_table) == 2
    assert b.num_computed_tokens == 8
    assert [dst for _, dst in batch.blocks_to_swap_out] == b.swap_table
    assert rows(batch) == [(a, 1)]
    s.check_invariants()
    s.finish(a, "abort")
    batch = s.schedule()                          # b comes back: its KV copied in, 1 token computed
    swapped_to = [dst for _, dst in batch.blocks_to_swap_in]
    assert len(swapped_to) == 2 and b.block_table[:2] == swapped_to
    assert rows(batch) == [(b, 1)] and b.status == SequenceStatus.RUNNING
    assert s.swap_pool.num_free_blocks == 8
    s.check_invariants()
