"""BlockManager: ref counts, chained-hash prefix cache, LRU reuse, and its invariants."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedllm.engine.block_manager import FREED_BLOCK, BlockManager, compute_hash
from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import SamplingParams

BS = 4


def can_allocate(bm: BlockManager, seq: Sequence) -> bool:
    """Whether a sequence without blocks can get all its tokens at once."""
    return bm.can_allocate_slots(seq, len(seq) - bm.num_reusable_tokens(seq))


def allocate(bm: BlockManager, seq: Sequence) -> list[tuple[int, int]]:
    """Blocks for all tokens of a sequence without blocks (an unchunked prefill)."""
    assert not seq.block_table, f"{seq} already holds blocks"
    return bm.allocate_slots(seq, len(seq) - bm.num_reusable_tokens(seq))


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), BS)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert can_allocate(bm, seq)
    allocate(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]
    bm.check_invariants([seq])
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_shared_prefix_is_reused_with_ref_counts():
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    allocate(bm, a)
    allocate(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8
    assert [bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    bm.check_invariants([a, b])
    bm.deallocate(a)
    assert [bm.blocks[x].ref_count for x in b.block_table[:2]] == [1, 1]
    bm.deallocate(b)
    assert bm.num_free_blocks == 16


def test_full_prompt_hit_still_computes_last_token():
    """nano-vllm #144 / #199: a prompt that is entirely cached must still run its last token."""
    bm = BlockManager(16, BS)
    a = make_seq(list(range(8)))  # exactly two full blocks
    allocate(bm, a)
    a_table = list(a.block_table)
    bm.deallocate(a)
    b = make_seq(list(range(8)))
    allocate(bm, b)
    assert b.num_cached_tokens == 4, "the block holding the last token must be recomputed"
    assert b.block_table[0] == a_table[0]
    assert b.block_table[1] != a_table[1]
    bm.check_invariants([b])


def test_reset_prefix_cache_forgets_freed_blocks_and_waits_for_used_ones():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    allocate(bm, a)
    assert not bm.reset_prefix_cache()  # a's blocks are in use: nothing forgotten
    assert len(bm.hash_to_block_id) == 2
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 2
    assert bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and bm.hash_to_block_id == {}
    b = make_seq(list(range(9)))
    allocate(bm, b)
    assert b.num_cached_tokens == 0
    bm.check_invariants([b])
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 2  # b's cached again


def test_freed_blocks_stay_cached_and_are_revived():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    allocate(bm, a)
    first_two = list(a.block_table[:2])
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 2
    b = make_seq(list(range(9)))
    allocate(bm, b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 8
    assert bm.num_hit_tokens == 8


def test_hash_collision_is_rejected_by_token_check():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5])
    allocate(bm, a)
    # Forge an index entry: the hash of other tokens pointing at a's first block.
    forged = compute_hash([9, 9, 9, 9])
    bm.hash_to_block_id[forged] = a.block_table[0]
    b = make_seq([9, 9, 9, 9, 1])
    assert bm.num_reusable_tokens(b) == 0
    del bm.hash_to_block_id[forged]


def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))        # blocks: 2 full + 1 partial
    allocate(bm, a)
    table = list(a.block_table)
    bm.deallocate(a)                    # freed tail first: table[2], table[1], table[0]
    order = list(bm.free_block_ids)
    assert order[-3:] == [table[2], table[1], table[0]]
    c = make_seq([100, 101, 102, 103, 104, 105, 106, 107, 108])  # needs 3 fresh blocks
    allocate(bm, c)
    # the never-used block goes first, then a's tail; a's first block survives
    assert table[0] not in c.block_table
    d = make_seq(list(range(5)))
    assert bm.num_reusable_tokens(d) == 4


def compute(seq: Sequence, n: int) -> None:
    """What a step does to a sequence after its n new tokens ran (Scheduler.postprocess)."""
    seq.num_computed_tokens += n


def test_decode_slots_allocate_at_block_boundary_and_hash_full_blocks():
    bm = BlockManager(8, BS)
    seq = make_seq([1, 2, 3])
    allocate(bm, seq)
    compute(seq, 3)
    seq.append_token(4)                # fills block 0
    assert bm.allocate_slots(seq, 1) == []
    compute(seq, 1)
    assert bm.blocks[seq.block_table[0]].hash == compute_hash([1, 2, 3, 4])
    seq.append_token(5)                # needs block 1
    assert bm.num_blocks_needed(seq, 1) == 1
    bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 2
    bm.check_invariants([seq])


def test_chunks_allocate_only_their_blocks_and_register_only_computed_full_blocks():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(1, 12)))  # 11 tokens: chunks of 5, 5, 1
    bm.allocate_slots(seq, 5)
    assert len(seq.block_table) == 2
    assert [bm.blocks[b].hash != -1 for b in seq.block_table] == [True, False]
    compute(seq, 5)
    bm.check_invariants([seq])
    bm.allocate_slots(seq, 5)           # tokens 5..9: block 1 becomes full, block 2 partial
    assert len(seq.block_table) == 3
    assert [bm.blocks[b].hash != -1 for b in seq.block_table] == [True, True, False]
    compute(seq, 5)
    bm.allocate_slots(seq, 1)
    compute(seq, 1)
    bm.check_invariants([seq])
    other = make_seq(list(range(1, 12)))
    assert bm.num_reusable_tokens(other) == 8


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_last_block():
    """Seed 001: "Four score and seven years ago our" -> "fathers" / "mothers"."""
    bm = BlockManager(8, BS)
    parent = make_seq([1, 2, 3, 4, 5, 6])          # block 0 full, block 1 holds 2 tokens
    allocate(bm, parent)
    compute(parent, 6)
    child = parent.fork()
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    bm.check_invariants([parent, child])
    parent.append_token(7)                         # "fathers"
    child.append_token(8)                          # "mothers"
    shared = parent.block_table[1]
    assert bm.num_blocks_needed(parent, 1) == 1    # the copy
    copies = bm.allocate_slots(parent, 1)
    assert copies == [(shared, parent.block_table[1])] and parent.block_table[1] != shared
    assert bm.blocks[shared].ref_count == 1
    assert bm.num_blocks_needed(child, 1) == 0     # the last holder writes in place
    assert bm.allocate_slots(child, 1) == [] and child.block_table[1] == shared
    assert bm.blocks[child.block_table[0]].ref_count == 2   # the full prompt block stays shared
    compute(parent, 1)
    compute(child, 1)
    bm.check_invariants([parent, child])
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_caching_off_never_shares():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    allocate(bm, a)
    allocate(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    assert all(blk.hash == -1 for blk in bm.blocks)


# ---- property-based: random chunked allocation / decode / fork / free keep the invariants -----

ops = st.lists(st.tuples(st.sampled_from(["new", "chunk", "append", "fork", "free"]),
                         st.integers(0, 50), st.lists(st.integers(0, 3), min_size=1, max_size=14)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_keep_block_accounting(operations):
    bm = BlockManager(12, BS)
    live: list[Sequence] = []

    def drop(seq: Sequence) -> None:
        bm.deallocate(seq)
        live.remove(seq)

    for op, pick, tokens in operations:
        seq = live[pick % len(live)] if live else None
        if op == "new":
            seq = make_seq(tokens)   # small alphabet: many shared prefixes
            n = min(len(seq) - bm.num_reusable_tokens(seq), 1 + pick % 5)  # a chunk
            if bm.can_allocate_slots(seq, n):
                free_before = bm.num_free_blocks
                bm.allocate_slots(seq, n)
                assert bm.num_free_blocks >= free_before - seq.num_blocks
                compute(seq, n)
                live.append(seq)
        elif op == "chunk" and seq is not None and seq.num_uncomputed_tokens:
            n = min(seq.num_uncomputed_tokens, 1 + pick % 5)
            needed = bm.num_blocks_needed(seq, n)
            if bm.can_allocate_slots(seq, n):
                free_before = bm.num_free_blocks
                bm.allocate_slots(seq, n)
                assert free_before - bm.num_free_blocks == needed
                compute(seq, n)
            else:
                drop(seq)
        elif op == "append" and seq is not None and not seq.num_uncomputed_tokens:
            seq.append_token(tokens[0])
            needed = bm.num_blocks_needed(seq, 1)
            if bm.can_allocate_slots(seq, 1):
                free_before = bm.num_free_blocks
                bm.allocate_slots(seq, 1)
                assert free_before - bm.num_free_blocks == needed
                compute(seq, 1)
            else:
                drop(seq)
        elif op == "fork" and seq is not None and not seq.num_uncomputed_tokens:
            child = seq.fork()
            bm.fork(seq, child)
            live.append(child)
        elif op == "free" and seq is not None:
            drop(seq)
        bm.check_invariants(live)
        assert bm.num_free_blocks + len(bm.used_block_ids) == bm.num_blocks
    for seq in list(live):
        drop(seq)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_lru_eviction_order_follows_last_use_and_hit_rate_counts_tokens():
    bm = BlockManager(4, BS)
    a, b = make_seq(list(range(5))), make_seq(list(range(100, 105)))  # 1 full block + 1 partial
    allocate(bm, a)
    allocate(bm, b)
    a_full, b_full = a.block_table[0], b.block_table[0]
    bm.deallocate(a)
    bm.deallocate(b)                    # free list: ..., a tail, a_full, b tail, b_full
    assert bm.num_cached_free_blocks == 2 and bm.hit_rate == 0.0
    again = make_seq(list(range(5)))    # revives a_full: a is now the most recently used
    allocate(bm, again)
    assert again.block_table[0] == a_full and bm.hit_rate == 4 / 12
    bm.deallocate(again)
    assert list(bm.free_block_ids)[-1] == a_full
    # Three fresh blocks evict the least recently freed first: b_full goes before a_full.
    c = make_seq(list(range(200, 211)))
    allocate(bm, c)
    assert b_full in c.block_table and a_full not in c.block_table
    assert bm.num_reusable_tokens(make_seq(list(range(100, 105)))) == 0   # evicted: unindexed
    assert bm.num_reusable_tokens(make_seq(list(range(5)))) == 4
    bm.check_invariants([c])


def test_kv_usage_counts_shared_blocks_once():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(10)))       # 3 blocks, 10 tokens: 2 slots unused
    allocate(bm, a)
    compute(a, 10)
    assert bm.kv_usage([a]) == (10, 12)
    b = a.fork()
    bm.fork(a, b)
    assert bm.kv_usage([a, b]) == (10, 12)
    b.append_token(3)
    bm.allocate_slots(b, 1)             # copy on write of the last block
    assert bm.kv_usage([a, b]) == (10 + 3, 16)


def _decode_steps(bm: BlockManager, seqs: list[Sequence], steps: int) -> None:
    """Each step: slots for every sequence's newest token, then its next token appended."""
    for step in range(steps):
        for seq in seqs:
            bm.allocate_slots(seq, len(seq) - seq.num_computed_tokens)
            seq.num_computed_tokens = len(seq)
            seq.append_token(1000 + step)
        bm.check_invariants(seqs)


def test_a_sliding_window_frees_blocks_that_fall_out_of_it():
    """Window 6, blocks of 4: the token at position p needs keys p-5..p, so a block is
    freed once every key in it is older than that; freed blocks keep their hash."""
    bm = BlockManager(16, BS, sliding_window=6)
    seq = make_seq(list(range(10)))
    allocate(bm, seq)
    seq.num_computed_tokens = len(seq)
    seq.append_token(99)
    _decode_steps(bm, [seq], 20)   # positions 10..29
    live = [b for b in seq.block_table if b != FREED_BLOCK]
    assert len(seq.block_table) == 8 and len(live) <= 3
    # the last query (position 29) needs keys 24..29: blocks 6 and 7 only
    assert seq.block_table[:5] == [FREED_BLOCK] * 5
    assert bm.num_free_blocks == 16 - len(live)
    assert bm.num_cached_free_blocks >= 5          # still revivable by their hash
    bm.deallocate(seq)
    assert bm.num_free_blocks == 16


def test_forks_share_a_window_and_free_their_own_references():
    bm = BlockManager(16, BS, sliding_window=6)
    parent = make_seq(list(range(9)))
    allocate(bm, parent)
    parent.num_computed_tokens = len(parent)
    parent.append_token(99)
    _decode_steps(bm, [parent], 3)
    child = parent.fork()
    bm.fork(parent, child)
    _decode_steps(bm, [parent, child], 12)
    bm.deallocate(parent)
    bm.check_invariants([child])
    bm.deallocate(child)
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)
