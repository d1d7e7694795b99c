"""Block and BlockManager: the physical KV-cache blocks, their ref counts and the prefix cache.

As in nano-vllm (seed 000): a full block is identified by a chained xxhash64 over
(previous block's hash, its token ids); a hash hit is accepted only when the stored token
ids match. Free blocks keep their hash, so a later request can revive them; the free list
is ordered least-recently-freed first, which makes reuse of cached blocks LRU.

With a sliding window on every layer, a sequence's leading blocks that lie wholly before
the window of its next new token are freed as it grows: their block-table entries become
FREED_BLOCK (-1), so a long generation holds about window / block_size + 1 blocks. Freed
blocks keep their hash: another request with the same prefix can still revive them.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from pagedllm.engine.sequence import Sequence
from pagedllm.utils import cdiv

FREED_BLOCK = -1  # a block-table entry whose block fell out of the sliding window


class Block:
    """One physical block: block_size token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1          # -1: not full, or not cacheable
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    """Chained hash of one full block: depends on every token before it too."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # set only when every layer has this window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Insertion order = order of freeing; the first key is the next block to (re)use.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # Prefix-cache statistics, counted in tokens of full blocks looked up.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_copy_on_writes = 0

    # ---- accounting -----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return sum(1 for b in self.free_block_ids
                   if self.hash_to_block_id.get(self.blocks[b].hash) == b)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    # ---- block moves ----------------------------------------------------------------------

    def _take_free_block(self, block_id: int | None = None) -> Block:
        """Move a free block to the used set; with no id, evict the least recently freed."""
        if block_id is None:
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]  # its cached content is being overwritten
            block.reset()
        else:
            del self.free_block_ids[block_id]
            block = self.blocks[block_id]
            block.ref_count = 1  # revived with its cached content
        assert block.ref_count == 1
        self.used_block_ids.add(block_id)
        return block

    def _release_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids[block_id] = None

    # ---- prefix cache ---------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first blocks, memoised on the sequence (tokens only grow)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_full_blocks):
            hashes.append(compute_hash(seq.block(i), hashes[-1] if hashes else -1))
        return hashes[:num_full_blocks]

    def _cached_block_ids(self, seq: Sequence, hashes: list[int]) -> list[int]:
        """Physical ids of the longest run of leading blocks found in the cache."""
        found: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != seq.block(i):
                break
            found.append(block_id)
        return found

    def _plan(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Hashes of the sequence's full blocks and the cached blocks it can reuse.

        Only blocks that end before the last token may be reused, so at least the last
        token is always computed and produces the logits to sample from (nano-vllm #144/#199).
        """
        if not self.enable_prefix_caching:
            return [], []
        hashes = self._block_hashes(seq, len(seq) // self.block_size)
        pooling = seq.sampling_params.pooling
        if seq.prompt_logprobs is not None or (pooling is not None and pooling.pooling == "mean"):
            return hashes, []  # it needs the logits or hidden states of every prompt token
        reusable = (len(seq) - 1) // self.block_size
        return hashes, self._cached_block_ids(seq, hashes[:reusable])

    # ---- the API the scheduler uses ---------------------------------------------------------

    def num_reusable_tokens(self, seq: Sequence) -> int:
        """How many leading tokens a sequence without blocks would take from the prefix cache."""
        if seq.block_table:
            return seq.num_computed_tokens
        return len(self._plan(seq)[1]) * self.block_size

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks allocate_slots(seq, num_new_tokens) would take off the free list:
        cached free blocks revived for its prefix, new blocks, and a copy-on-write copy."""
        bs = self.block_size
        if seq.block_table:
            table, computed, revive = seq.block_table, seq.num_computed_tokens, 0
        else:
            _, table = self._plan(seq)
            computed = len(table) * bs
            revive = sum(1 for b in table if b not in self.used_block_ids)
        new = max(0, cdiv(computed + num_new_tokens, bs) - len(table))
        i = computed // bs
        cow = int(bool(seq.block_table) and i < len(table) and self.blocks[table[i]].ref_count > 1)
        return revive + new + cow

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= len(self.free_block_ids)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> list[tuple[int, int]]:
        """Give the sequence slots for its next num_new_tokens tokens (after its computed ones)
        and num_lookahead_tokens more for draft tokens to verify (speculative decoding).

        A sequence without blocks first takes its cached prefix. If the first slot lies in a
        block shared with another sequence (a fork), that block is copied first; the
        returned (src, dst) block pairs are the KV copies to make before the forward pass.
        Blocks that this step fills completely are registered in the prefix cache: their KV
        is written in the coming step, before any other sequence of that step reads it
        (store precedes attention in every layer). Lookahead slots hold no accepted token
        yet: they make no block full (commit_speculation registers what is accepted).
        """
        if not seq.block_table:
            self._allocate_cached_prefix(seq)
        bs, table = self.block_size, seq.block_table
        start = seq.num_computed_tokens
        if self.sliding_window is not None:
            self._free_out_of_window(seq, start)
        end = start + num_new_tokens
        assert 0 < end <= len(seq), f"{seq}: cannot compute {num_new_tokens} more tokens"
        assert len(table) <= start // bs + 1, f"{seq} holds blocks beyond its computed tokens"
        copies = []
        i = start // bs
        if i < len(table) and self.blocks[table[i]].ref_count > 1:
            copies.append(self._copy_on_write(seq, i))
        while len(table) * bs < end + num_lookahead_tokens:
            table.append(self._take_free_block().block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start // bs, end // bs)
        return copies

    def commit_speculation(self, seq: Sequence, start: int) -> None:
        """After a verified row that computed from token start on and advanced
        num_computed_tokens past its accepted drafts: free the blocks past the computed
        tokens (they hold only rejected drafts' KV; the rejected slots of the last kept block
        are overwritten later) and register the blocks the accepted drafts filled."""
        table, bs = seq.block_table, self.block_size
        while len(table) > cdiv(seq.num_computed_tokens, bs):
            self._unref(table.pop())
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start // bs, seq.num_computed_tokens // bs)

    def _free_out_of_window(self, seq: Sequence, start: int) -> None:
        """Drop the blocks wholly before the window of the token at position start (and so
        of every later one). Freed entries form a prefix of the table: walk back from the
        last dead block to the first entry already freed."""
        table = seq.block_table
        i = min(len(table), max(0, start - self.sliding_window + 1) // self.block_size) - 1
        while i >= 0 and table[i] != FREED_BLOCK:
            self._unref(table[i])
            table[i] = FREED_BLOCK
            i -= 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._release_block(block_id)

    def _allocate_cached_prefix(self, seq: Sequence) -> None:
        hashes, cached = self._plan(seq)
        for block_id in cached:
            if block_id in self.used_block_ids:
                self.blocks[block_id].ref_count += 1
            else:
                self._take_free_block(block_id)
            seq.block_table.append(block_id)
        seq.num_cached_tokens = seq.num_computed_tokens = len(cached) * self.block_size
        self.num_query_tokens += len(hashes) * self.block_size
        self.num_hit_tokens += seq.num_cached_tokens

    def _copy_on_write(self, seq: Sequence, i: int) -> tuple[int, int]:
        """Replace the shared logical block i of seq by a private copy; return (src, dst)."""
        src = self.blocks[seq.block_table[i]]
        dst = self._take_free_block()
        src.ref_count -= 1
        assert src.ref_count > 0
        seq.block_table[i] = dst.block_id
        self.num_copy_on_writes += 1
        return src.block_id, dst.block_id

    def _register_full_blocks(self, seq: Sequence, first: int, last: int) -> None:
        """Make logical blocks [first, last) of seq findable by their chained hash."""
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                self._register(block, self._block_hashes(seq, i + 1)[i], seq.block(i))

    def _register(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.update(h, token_ids)
        self.hash_to_block_id[h] = block.block_id

    def allocate_swapped_in(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Fresh blocks for a sequence coming back from the swap pool; its computed full
        blocks are registered in the prefix cache again once their KV is copied back."""
        assert not seq.block_table
        seq.block_table = [self._take_free_block().block_id for _ in range(num_blocks)]
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, 0, seq.num_computed_tokens // self.block_size)
        return seq.block_table

    def release_for_swap(self, seq: Sequence) -> list[int]:
        """Drop the sequence's blocks after their KV was scheduled to be copied out; keeps
        num_computed_tokens (the KV is kept, elsewhere). Returns the blocks it held."""
        table = list(seq.block_table)
        computed = seq.num_computed_tokens
        self.deallocate(seq)
        seq.num_computed_tokens = computed
        return table

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child share every block of parent (ref counts + 1); they are copied on write."""
        assert not child.block_table
        for block_id in parent.block_table:
            if block_id != FREED_BLOCK:
                self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's references, last block first: tail blocks are the least
        shareable, so they are freed (and later evicted) first."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED_BLOCK:
                self._unref(block_id)
        seq.num_cached_tokens = seq.num_computed_tokens = 0
        seq.block_table.clear()

    def forget_hashes(self, seq: Sequence) -> None:
        """Drop the cache entries of blocks only this sequence holds, e.g. after a failed step
        left their KV unwritten; blocks other sequences hold keep theirs."""
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            if block_id != FREED_BLOCK and block.ref_count == 1 and block.hash != -1:
                if self.hash_to_block_id.get(block.hash) == block_id:
                    del self.hash_to_block_id[block.hash]
                block.hash, block.token_ids = -1, []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache), so the next prompts are
        computed in full; refused (False) while any block is in use."""
        if self.used_block_ids:
            return False
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        self.hash_to_block_id.clear()
        return True

    # ---- memory report ----------------------------------------------------------------------

    def kv_usage(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(tokens held, token slots allocated) over the used blocks of seqs: a block shared
        by several sequences counts once, holding as many tokens as its fullest holder."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq in seqs:
            n = len(seq)
            for i, block_id in enumerate(seq.block_table):
                if block_id == FREED_BLOCK:
                    continue
                held = max(0, min(bs, n - i * bs))
                fill[block_id] = max(fill.get(block_id, 0), held)
        return sum(fill.values()), len(fill) * bs

    # ---- invariants ---------------------------------------------------------------------------

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError with a precise message if the accounting is inconsistent.

        seqs must be every sequence that currently holds blocks.
        """
        refs = [0] * len(self.blocks)
        for seq in seqs:
            for block_id in seq.block_table:
                if block_id != FREED_BLOCK:
                    refs[block_id] += 1
        for block in self.blocks:
            i = block.block_id
            if block.ref_count != refs[i]:
                raise AssertionError(f"block {i}: ref_count {block.ref_count} but "
                                     f"{refs[i]} block tables hold it")
            in_free, in_used = i in self.free_block_ids, i in self.used_block_ids
            if in_free == in_used:
                raise AssertionError(f"block {i}: free={in_free} used={in_used}")
            if in_free != (block.ref_count == 0):
                raise AssertionError(f"block {i}: free={in_free} with ref_count {block.ref_count}")
        for h, i in self.hash_to_block_id.items():
            block = self.blocks[i]
            if block.hash != h or len(block.token_ids) != self.block_size:
                raise AssertionError(f"hash index points at block {i} holding "
                                     f"{len(block.token_ids)} tokens with hash {block.hash}")
        for seq in seqs:
            if not 0 <= seq.num_computed_tokens <= min(len(seq), len(seq.block_table) * self.block_size):
                raise AssertionError(f"{seq}: {seq.num_computed_tokens} computed tokens but "
                                     f"{len(seq.block_table)} blocks")
            if len(seq.block_table) > cdiv(len(seq) + len(seq.spec_token_ids), self.block_size):
                raise AssertionError(f"{seq}: holds blocks past its tokens and draft tokens "
                                     f"{seq.spec_token_ids} (rejected drafts' slots not freed)")
            prefix = -1
            for j, block_id in enumerate(seq.block_table):
                if block_id == FREED_BLOCK:  # the chain goes on through the tokens' hashes
                    if self.sliding_window is None:
                        raise AssertionError(f"{seq}: freed block {j} without a sliding window")
                    prefix = compute_hash(seq.block(j), prefix) if prefix != -1 or j == 0 else -1
                    continue
                block = self.blocks[block_id]
                if block.hash == -1:
                    prefix = -1
                    continue
                if j > 0 and prefix == -1:
                    raise AssertionError(f"{seq}: block {block_id} is hashed but its "
                                         f"predecessor is not")
                if block.token_ids != seq.block(j):
                    raise AssertionError(f"{seq}: block {block_id} holds other tokens "
                                         f"than logical block {j}")
                if compute_hash(block.token_ids, prefix) != block.hash:
                    raise AssertionError(f"{seq}: block {block_id} hash is not the "
                                         f"chained hash of its prefix")
                prefix = block.hash
