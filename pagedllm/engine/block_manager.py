"""Block and BlockManager: the physical KV-cache blocks, their ref counts and the prefix cache.

As in nano-vllm (seed 000): a full block is identified by a chained xxhash64 over
(previous block's hash, its token ids); a hash hit is accepted only when the stored token
ids match. Free blocks keep their hash, so a later request can revive them; the free list
is ordered least-recently-freed first, which makes reuse of cached blocks LRU.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from pagedllm.engine.sequence import Sequence


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Insertion order = order of freeing; the first key is the next block to (re)use.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # Prefix-cache statistics, counted in tokens of full blocks looked up.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

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
        reusable = (len(seq) - 1) // self.block_size
        return hashes, self._cached_block_ids(seq, hashes[:reusable])

    # ---- the API the scheduler uses ---------------------------------------------------------

    def num_reusable_tokens(self, seq: Sequence) -> int:
        """How many leading tokens allocate() would take from the prefix cache."""
        return len(self._plan(seq)[1]) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        _, cached = self._plan(seq)
        # A cached block that is free still has to be taken out of the free list.
        needed = seq.num_blocks - sum(1 for b in cached if b in self.used_block_ids)
        return needed <= len(self.free_block_ids)

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table, f"{seq} already holds blocks"
        hashes, cached = self._plan(seq)
        for block_id in cached:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                self._take_free_block(block_id)
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(cached) * self.block_size
        for i in range(len(cached), seq.num_blocks):
            block = self._take_free_block()
            if i < len(hashes):
                # The KV of this block is written in the coming prefill step, before any
                # other sequence of that step reads it (store precedes attention per layer).
                self._register(block, hashes[i], seq.block(i))
            seq.block_table.append(block.block_id)
        self.num_query_tokens += len(hashes) * self.block_size
        self.num_hit_tokens += seq.num_cached_tokens

    def _register(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.update(h, token_ids)
        self.hash_to_block_id[h] = block.block_id

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's references, last block first: tail blocks are the least
        shareable, so they are freed (and later evicted) first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def forget_hashes(self, seq: Sequence) -> None:
        """Drop the cache entries of blocks only this sequence holds, e.g. after a failed step
        left their KV unwritten; blocks other sequences hold keep theirs."""
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            if block.ref_count == 1 and block.hash != -1:
                if self.hash_to_block_id.get(block.hash) == block_id:
                    del self.hash_to_block_id[block.hash]
                block.hash, block.token_ids = -1, []

    def can_append(self, seq: Sequence) -> bool:
        """Whether the slot for the sequence's newest token can be provided."""
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        """Make room for the newest token (already appended to seq) before it is computed."""
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            block_table.append(self._take_free_block().block_id)
        elif len(seq) % self.block_size == 0 and self.enable_prefix_caching:
            # The last block becomes full with this token: make it findable by its hash.
            assert last_block.hash == -1
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            token_ids = seq.block(seq.num_blocks - 1)
            self._register(last_block, compute_hash(token_ids, prefix), token_ids)

    # ---- invariants ---------------------------------------------------------------------------

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError with a precise message if the accounting is inconsistent.

        seqs must be every sequence that currently holds blocks.
        """
        refs = [0] * len(self.blocks)
        for seq in seqs:
            for block_id in seq.block_table:
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
            prefix = -1
            for j, block_id in enumerate(seq.block_table):
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
