"""Tensor-parallel worker processes (seed 002): rank 0 schedules and samples, ranks 1..N-1
run their shard of the model on the inputs rank 0 publishes for each step.

A step is either a forward pass (input ids, positions, the rows whose logits are computed,
and the attention Context: num_decodes, cu_seqlens, slot_mapping, context_lens,
block_tables) or the KV-block moves that precede one (swap-out, swap-in, copy-on-write),
each a flat int64 array written as raw bytes into the TCPStore that rank 0 hosts for the
process group: nothing is unpickled, and the same channel spans machines. A worker waits
for the next step on the store without a deadline, so an idle engine never trips a
timeout (the wait ends at once if rank 0's store goes away), while the collectives of a
running step do time out (distributed_timeout_seconds).

Shutdown: rank 0 publishes EXIT and joins the workers; a worker that does not leave in
time is terminated, then killed. Workers ignore Ctrl-C (rank 0 decides), die with their
parent (PR_SET_PDEATHSIG), and are daemonic, so no process outlives the engine.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.attention.context import Context
from pagedllm.distributed import DistInfo

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

RUN, EXIT, MOVE = 1, 2, 3
_KEY = "pagedllm/step/{}"
_ACK = "pagedllm/exit/{}"
_IDLE_WAIT = timedelta(days=7)


class TensorParallelError(RuntimeError):
    """A rank died, hung or failed mid-step: the process group is unusable."""


# ---- the step description -------------------------------------------------------------------

@dataclass
class StepInputs:
    """Everything a rank needs to run one forward pass exactly as rank 0 does: the model
    inputs, the Context, and the tokens whose logits are computed (every rank takes part in
    the LM head's gather, so every rank must pick the same rows; none = no LM head)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context: Context
    logit_rows: torch.Tensor


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


# ---- signals --------------------------------------------------------------------------------

@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends: a step abandoned half way would leave the other
    ranks waiting in a collective. Only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# ---- rank > 0 ---------------------------------------------------------------------------------

def worker_main(config: "EngineConfig", info: DistInfo, parent_pid: int | None) -> None:
    """Entry point of ranks 1..N-1: build the model shard, then run steps until EXIT."""
    from pagedllm.engine.model_runner import ModelRunner
    from pagedllm.loader import load_model_source
    from pagedllm.logger import init_logging

    init_logging()
    if parent_pid is not None:
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    source = load_model_source(config.model)
    runner = ModelRunner(config, source.config, source.weights(config.torch_dtype), info)
    runner.worker_loop()
    logger.debug("rank %d: exit", info.rank)


def serve_worker_rank(config: "EngineConfig", info: DistInfo) -> None:
    """A rank > 0 started by torchrun: serve rank 0 until it exits, then leave the process
    (the rest of the user's script is rank 0's business)."""
    logger.info("rank %d of %d: serving tensor-parallel steps for rank 0 at %s:%d", info.rank,
                info.world_size, info.master_addr, info.master_port)
    worker_main(config, info, parent_pid=None)
    raise SystemExit(0)


# ---- rank 0's view of the workers -------------------------------------------------------------

def default_num_threads(local_world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores divided among the ranks on it."""
    return max(1, (os.cpu_count() or 1) // local_world_size)


class WorkerProcesses:
    """The N-1 local worker processes rank 0 spawned (empty under torchrun)."""

    def __init__(self, config: "EngineConfig", info: DistInfo, spawn: bool) -> None:
        self.info = info
        self.procs: list[mp.process.BaseProcess] = []
        if not spawn:
            return
        ctx = mp.get_context("spawn")
        for rank in range(1, info.world_size):
            proc = ctx.Process(target=worker_main, name=f"pagedllm-tp-rank{rank}", daemon=True,
                               args=(config, replace(info, rank=rank, local_rank=rank),
                                     os.getpid()))
            proc.start()
            self.procs.append(proc)
        logger.info("tensor parallel: started %d worker processes (pids %s)", len(self.procs),
                    [p.pid for p in self.procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def dead(self) -> list[str]:
        """'rank r (pid p) exit code c' for every worker that is gone."""
        return [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def check_alive(self) -> None:
        dead = self.dead()
        if dead:
            raise TensorParallelError("tensor-parallel worker died: " + "; ".join(dead))

    def failure(self, error: BaseException, what: str = "step", grace_s: float = 2.0
                ) -> TensorParallelError:
        """Explain a failed collective: wait briefly for a dying worker to be reaped."""
        deadline = time.monotonic() + grace_s
        while not self.dead() and self.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self.dead()
        cause = ("worker died: " + "; ".join(dead)) if dead else f"{type(error).__name__}: {error}"
        return TensorParallelError(f"tensor-parallel {what} failed, the engine cannot continue "
                                   f"({cause})")

    def join(self, timeout_s: float) -> None:
        """Wait for the workers to exit; terminate, then kill, any that do not.
        With timeout_s == 0 (a broken group) kill at once: a stopped or hung process may
        never act on SIGTERM."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive() and timeout_s > 0:
                logger.warning("worker pid %s did not exit; terminating it", p.pid)
                p.terminate()
                p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)

    def wait_for_acks(self, store: dist.TCPStore, timeout_s: float) -> None:
        """Under torchrun: wait until every rank has read EXIT before the store goes away."""
        keys = [_ACK.format(r) for r in range(1, self.info.world_size)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            logger.warning("not every tensor-parallel rank acknowledged EXIT")


def acknowledge_exit(store: dist.TCPStore, rank: int) -> None:
    store.set(_ACK.format(rank), b"1")
