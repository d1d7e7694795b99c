"""Tensor-parallel process group: rank and size of this process, collectives, rendezvous.

One process is rank 0 of 1 and never touches torch.distributed. With N ranks, every rank
joins one torch.distributed group (gloo on CPU, NCCL on CUDA) through a TCPStore hosted by
rank 0; the store also carries rank 0's step descriptions to the others (engine/workers.py).
The layers read get_tp_rank() / get_tp_size() when they are built, so set_tp comes first.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def set_tp(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's value (e.g. the KV blocks all ranks can hold)."""
    if _TP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL_GROUP)
    return int(t.item())


# ---- rendezvous ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: torchrun's variables, or what the engine gave its workers."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> DistInfo | None:
    """The torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) when an external launcher set them, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    return DistInfo(rank, world, local_rank, local_world, addr, port)


_HELLO = "pagedllm/hello/{}"
_STORE: dist.TCPStore | None = None
_CONTROL_GROUP: dist.ProcessGroup | None = None


def _wait_for_ranks(store: dist.TCPStore, world_size: int, timeout_s: float,
                    check_alive: Callable[[], None]) -> None:
    """Rank 0: wait until every rank has reached the store, calling check_alive between
    short waits, so a worker that dies while starting fails the engine at once."""
    keys = [_HELLO.format(r) for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        check_alive()
        try:
            store.wait(keys, timedelta(seconds=0.5))
            return
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every tensor-parallel rank reached the rendezvous "
                                   f"within {timeout_s:.0f} s") from None


def init_distributed(info: DistInfo, backend: str, timeout_s: float,
                     check_alive: Callable[[], None] | None = None) -> dist.TCPStore:
    """Join the group. Collectives that wait longer than timeout_s raise instead of hanging."""
    global _STORE, _CONTROL_GROUP
    timeout = timedelta(seconds=timeout_s)
    # torchrun's agent already serves a store on MASTER_PORT; then every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                          is_master=info.rank == 0 and not agent_store, timeout=timeout,
                          wait_for_workers=False)
    if info.rank > 0:
        store.set(_HELLO.format(info.rank), b"1")
    elif check_alive is not None:
        _wait_for_ranks(store, info.world_size, timeout_s, check_alive)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timeout)
    # Control traffic (block-count agreement) stays on CPU even when the model uses NCCL.
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    _STORE = store
    set_tp(info.rank, info.world_size)
    return store


def get_store() -> dist.TCPStore:
    assert _STORE is not None, "init_distributed() first"
    return _STORE


def destroy_distributed() -> None:
    global _STORE, _CONTROL_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _STORE = _CONTROL_GROUP = None
    set_tp(0, 1)
