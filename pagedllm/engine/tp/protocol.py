"""The messages of a tensor-parallel step and the channel that carries them.

A step is either a forward pass (input ids, positions, the rows whose logits are computed,
and the attention Context: num_decodes, cu_seqlens, slot_mapping, context_lens,
block_tables) or the KV-block moves that precede one (swap-out, swap-in, copy-on-write),
each a flat int64 array written as raw bytes into the TCPStore that rank 0 hosts for the
process group: nothing is unpickled, and the same channel spans machines. A worker waits
for the next step on the store without a deadline, so an idle engine never trips a
timeout (the wait ends at once if rank 0's store goes away), while the collectives of a
running step do time out (distributed_timeout_seconds).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.attention.context import Context
from pagedllm.engine.tp.errors import TensorParallelError

RUN, EXIT, MOVE = 1, 2, 3
_KEY = "pagedllm/step/{}"
_ACK = "pagedllm/exit/{}"
_IDLE_WAIT = timedelta(days=7)


@dataclass
class StepInputs:
    """Everything a rank needs to run one forward pass exactly as rank 0 does: the model
    inputs, the Context, and the tokens whose logits are computed (every rank takes part in
    the LM head's gather, so every rank must pick the same rows; none = no LM head)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context: Context
    logit_rows: torch.Tensor
    # rank 0 pools hidden states this step: every rank runs the whole last layer (not only
    # the logit rows'), so that their collectives match
    full_forward: bool = False


@dataclass
class BlockMoves:
    """The KV-block moves scheduled before a forward pass, as (src, dst) block ids: swap-out
    (device -> swap), swap-in (swap -> device), copy-on-write (device -> device). Each rank
    applies them to its own KV shard and its own swap space."""

    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]


Step = StepInputs | BlockMoves | None   # None = EXIT

_CONTEXT_ARRAYS = ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens")


def _pack(cmd: int, scalars: list[int], arrays: list[torch.Tensor | None]) -> bytes:
    """One int64 array: [cmd, #scalars, #arrays, scalars..., len of each array (-1 = None),
    the arrays' data...]."""
    header = [cmd, len(scalars), len(arrays), *scalars,
              *(a.numel() if a is not None else -1 for a in arrays)]
    parts = [np.array(header, dtype=np.int64)]
    parts += [a.numpy().reshape(-1) for a in arrays if a is not None]
    return np.concatenate([p.astype(np.int64, copy=False) for p in parts]).tobytes()


def _unpack(blob: bytes) -> tuple[int, list[int], list[torch.Tensor | None]]:
    data = torch.from_numpy(np.frombuffer(blob, dtype=np.int64).copy())
    cmd, num_scalars, num_arrays = data[:3].tolist()
    scalars = data[3:3 + num_scalars].tolist()
    lengths = data[3 + num_scalars:3 + num_scalars + num_arrays].tolist()
    pos = 3 + num_scalars + num_arrays
    arrays: list[torch.Tensor | None] = []
    for n in lengths:
        arrays.append(data[pos:pos + n] if n >= 0 else None)
        pos += max(n, 0)
    return cmd, scalars, arrays


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1)


def pack_step(step: Step) -> bytes:
    if step is None:
        return _pack(EXIT, [], [])
    if isinstance(step, BlockMoves):
        return _pack(MOVE, [], [_pairs(step.blocks_to_swap_out), _pairs(step.blocks_to_swap_in),
                                _pairs(step.blocks_to_copy)])
    ctx = step.context
    tables = ctx.block_tables
    rows, cols = tables.shape if tables is not None else (-1, -1)
    scalars = [int(ctx.is_prefill), ctx.num_decodes, ctx.max_seqlen_q, ctx.max_seqlen_k,
               rows, cols]
    arrays = [step.input_ids, step.positions, step.logit_rows, tables,
              *(getattr(ctx, name) for name in _CONTEXT_ARRAYS)]
    return _pack(RUN, scalars, arrays)


def unpack_step(blob: bytes) -> Step:
    """The inverse of pack_step."""
    cmd, scalars, arrays = _unpack(blob)
    if cmd == EXIT:
        return None
    if cmd == MOVE:
        out, into, copy = (a.view(-1, 2).tolist() for a in arrays if a is not None)
        return BlockMoves([tuple(p) for p in out], [tuple(p) for p in into],
                          [tuple(p) for p in copy])
    if cmd != RUN:
        raise TensorParallelError(f"unknown step command {cmd}")
    is_prefill, num_decodes, max_q, max_k, rows, cols = scalars
    input_ids, positions, logit_rows, tables, *values = arrays
    assert input_ids is not None and positions is not None and logit_rows is not None
    ctx = Context(is_prefill=bool(is_prefill), num_decodes=num_decodes, max_seqlen_q=max_q,
                  max_seqlen_k=max_k,
                  block_tables=tables.view(rows, cols) if tables is not None else None,
                  **dict(zip(_CONTEXT_ARRAYS, values)))
    if ctx.cu_seqlens_q is not None and ctx.cu_seqlens_k is not None:
        # the host copies the CPU backends read
        ctx = replace(ctx, seqlens_q=ctx.cu_seqlens_q.diff().tolist(),
                      seqlens_k=ctx.cu_seqlens_k.diff().tolist())
    return StepInputs(input_ids, positions, ctx, logit_rows)


class StepChannel:
    """Rank 0 publishes numbered steps in the TCPStore; every other rank reads them in order.

    A step's key is deleted only once every rank has surely read it: when rank 0 publishes
    a step, the forward pass it published last has finished its collectives, so every rank
    has read that step and every step before it. Block moves have no collective, so the
    keys of moves published since stay until the next forward pass is over.
    """

    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store
        self.n = 0
        self._oldest = 0          # the oldest step whose key still exists
        self._last_forward = -1   # the last forward pass published

    def publish(self, step: Step) -> None:
        self.store.set(_KEY.format(self.n), pack_step(step))
        for old in range(self._oldest, self._last_forward + 1):
            self.store.delete_key(_KEY.format(old))
        self._oldest = max(self._oldest, self._last_forward + 1)
        if isinstance(step, StepInputs):
            self._last_forward = self.n
        self.n += 1

    def receive(self) -> Step:
        key = _KEY.format(self.n)
        while True:
            try:
                self.store.wait([key], _IDLE_WAIT)
                break
            except dist.DistStoreError as e:  # an engine idle for a week: keep waiting
                if "timeout" not in str(e).lower():
                    raise
        self.n += 1
        return unpack_step(self.store.get(key))


def acknowledge_exit(store: dist.TCPStore, rank: int) -> None:
    store.set(_ACK.format(rank), b"1")


def wait_for_acks(store: dist.TCPStore, world_size: int, timeout_s: float) -> bool:
    """Under torchrun: wait until every rank has read EXIT before the store goes away;
    whether they all did."""
    keys = [_ACK.format(r) for r in range(1, world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        return False
    return True
