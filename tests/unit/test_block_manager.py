"""BlockManager: ref counts, chained-hash prefix cache, LRU reuse, and its invariants."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedllm.engine.block_manager import BlockManager, compute_hash
from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), BS)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert bm.can_allocate(seq)
    bm.allocate(seq)
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
    bm.allocate(a)
    bm.allocate(b)
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
    bm.allocate(a)
    a_table = list(a.block_table)
    bm.deallocate(a)
    b = make_seq(list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4, "the block holding the last token must be recomputed"
    assert b.block_table[0] == a_table[0]
    assert b.block_table[1] != a_table[1]
    bm.check_invariants([b])


def test_freed_blocks_stay_cached_and_are_revived():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    bm.allocate(a)
    first_two = list(a.block_table[:2])
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 2
    b = make_seq(list(range(9)))
    bm.allocate(b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 8
    assert bm.num_hit_tokens == 8


def test_hash_collision_is_rejected_by_token_check():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    # Forge an index entry: the hash of other tokens pointing at a's first block.
    forged = compute_hash([9, 9, 9, 9])
    bm.hash_to_block_id[forged] = a.block_table[0]
    b = make_seq([9, 9, 9, 9, 1])
    assert bm.num_reusable_tokens(b) == 0
    del bm.hash_to_block_id[forged]


def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))        # blocks: 2 full + 1 partial
    bm.allocate(a)
    table = list(a.block_table)
    bm.deallocate(a)                    # freed tail first: table[2], table[1], table[0]
    order = list(bm.free_block_ids)
    assert order[-3:] == [table[2], table[1], table[0]]
    c = make_seq([100, 101, 102, 103, 104, 105, 106, 107, 108])  # needs 3 fresh blocks
    bm.allocate(c)
    # the never-used block goes first, then a's tail; a's first block survives
    assert table[0] not in c.block_table
    d = make_seq(list(range(5)))
    assert bm.num_reusable_tokens(d) == 4


def test_may_append_allocates_at_block_boundary_and_hashes_full_blocks():
    bm = BlockManager(8, BS)
    seq = make_seq([1, 2, 3])
    bm.allocate(seq)
    seq.append_token(4)                # fills block 0
    bm.may_append(seq)
    assert bm.blocks[seq.block_table[0]].hash == compute_hash([1, 2, 3, 4])
    seq.append_token(5)                # needs block 1
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    bm.check_invariants([seq])


def test_prefix_caching_off_never_shares():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    bm.allocate(a)
    bm.allocate(b)
    assert not set(a.block_table) & set(b.block_table)
    assert all(blk.hash == -1 for blk in bm.blocks)


# ---- property-based: random allocate / append / free sequences keep the invariants ----------

ops = st.lists(st.tuples(st.sampled_from(["new", "append", "free"]),
                         st.integers(0, 50), st.lists(st.integers(0, 3), min_size=1, max_size=14)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_keep_block_accounting(operations):
    bm = BlockManager(12, BS)
    live: list[Sequence] = []
    for op, pick, tokens in operations:
        if op == "new":
            seq = make_seq(tokens)   # small alphabet: many shared prefixes
            if bm.can_allocate(seq):
                free_before = bm.num_free_blocks
                bm.allocate(seq)
                assert bm.num_free_blocks >= free_before - seq.num_blocks
                live.append(seq)
        elif op == "append" and live:
            seq = live[pick % len(live)]
            seq.append_token(tokens[0])
            if bm.can_append(seq):
                bm.may_append(seq)
            else:
                bm.deallocate(seq)
                live.remove(seq)
        elif op == "free" and live:
            bm.deallocate(live.pop(pick % len(live)))
        bm.check_invariants(live)
        assert bm.num_free_blocks + len(bm.used_block_ids) == bm.num_blocks
    for seq in live:
        bm.deallocate(seq)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
