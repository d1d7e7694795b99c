"""Rank 0's side of tensor parallelism's processes: its place in the group, the N-1 local
worker processes it spawns, and Ctrl-C held off while a step runs.

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
from dataclasses import replace
from typing import Callable, Iterator

import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed import DistInfo, free_port, torchrun_env
from pagedllm.engine.tp.errors import TensorParallelError
from pagedllm.engine.tp.protocol import wait_for_acks

logger = logging.getLogger(__name__)


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends: a step abandoned half way would leave the other
    ranks waiting in a collective. Only the main thread can install handlers. A process
    that ignores SIGINT (a background job of a script: `cmd &`) keeps ignoring it."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) == signal.SIG_IGN):
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


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def rank0_dist_info(tp: int) -> tuple[DistInfo, bool]:
    """Rank 0's place in the group and whether it must spawn the other ranks itself
    (not when torchrun or a similar launcher started every rank)."""
    env = torchrun_env()
    if env is not None and env.world_size > 1:
        if env.world_size != tp:
            raise ValueError(f"WORLD_SIZE={env.world_size} in the environment but "
                             f"tensor_parallel_size={tp}; they must match")
        return env, False
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or free_port())
    return DistInfo(0, tp, 0, tp, addr, port), True


def default_num_threads(local_world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores divided among the ranks on it."""
    return max(1, (os.cpu_count() or 1) // local_world_size)


class WorkerProcesses:
    """The N-1 local worker processes rank 0 spawned (empty under torchrun)."""

    def __init__(self, config: EngineConfig, info: DistInfo, spawn: bool,
                 target: Callable[[EngineConfig, DistInfo, int], None]) -> None:
        """target(config, info, parent pid): each spawned rank's entry point
        (engine/tp/worker.py worker_main)."""
        self.info = info
        self.procs: list[mp.process.BaseProcess] = []
        if not spawn:
            return
        ctx = mp.get_context("spawn")
        for rank in range(1, info.world_size):
            proc = ctx.Process(target=target, name=f"pagedllm-tp-rank{rank}", daemon=True,
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
        if not wait_for_acks(store, self.info.world_size, timeout_s):
            logger.warning("not every tensor-parallel rank acknowledged EXIT")
