"""Tensor-parallel process group: rank and size of this process, collectives, rendezvous.

One process is rank 0 of 1 and never touches torch.distributed. With N ranks, every rank
joins one torch.distributed group (gloo on CPU, NCCL on CUDA) through a TCPStore hosted by
rank 0; the store also carries rank 0's step descriptions to the others (engine/workers.py) and the start-up handshakes.
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
    return min(int(v) for v in all_gather_str("min", str(value)))


def all_gather_str(name: str, value: str) -> list[str]:
    """Every rank's value for `name`, in rank order.

    Exchanged through the store, not a collective: ranks finish loading the model at
    different times, and start-up must not be bounded by the (short) collective timeout."""
    if _TP_SIZE == 1:
        return [value]
    store = get_store()
    store.set(_GATHER.format(name, _TP_RANK), value)
    keys = [_GATHER.format(name, r) for r in range(_TP_SIZE)]
    _wait_keys(store, keys, _STARTUP_TIMEOUT_S, _CHECK_ALIVE)
    return [store.get(k).decode() for k in keys]


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
_GATHER = "pagedllm/gather/{}/{}"
# Start-up (imports, weight loading on every rank) may take longer than a collective may
# wait; rank 0 polls the workers' liveness meanwhile, so a dead one still fails at once.
STARTUP_TIMEOUT_S = 600.0
_STARTUP_TIMEOUT_S = STARTUP_TIMEOUT_S
_CHECK_ALIVE: Callable[[], None] | None = None
_STORE: dist.TCPStore | None = None


def _wait_keys(store: dist.TCPStore, keys: list[str], timeout_s: float,
               check_alive: Callable[[], None] | None) -> None:
    """Wait for every key, calling check_alive (rank 0: are the workers alive?) between
    short waits, so a worker that dies while starting fails the engine at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check_alive is not None:
            check_alive()
        if store.check(keys):  # a non-blocking test: a timed-out wait() would log warnings
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every tensor-parallel rank reached the start-up step "
                               f"{keys[0].rsplit('/', 1)[0]} within {timeout_s:.0f} s")
        time.sleep(0.1)


def init_distributed(info: DistInfo, backend: str, timeout_s: float,
                     check_alive: Callable[[], None] | None = None) -> dist.TCPStore:
    """Join the group. Collectives that wait longer than timeout_s raise instead of hanging."""
    global _STORE, _STARTUP_TIMEOUT_S, _CHECK_ALIVE
    timeout = timedelta(seconds=timeout_s)
    # torchrun's agent already serves a store on MASTER_PORT; then every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                          is_master=info.rank == 0 and not agent_store, timeout=timeout,
                          wait_for_workers=False)
    _STARTUP_TIMEOUT_S = max(timeout_s, STARTUP_TIMEOUT_S)
    _CHECK_ALIVE = check_alive
    if info.rank > 0:
        store.set(_HELLO.format(info.rank), b"1")
    else:
        _wait_keys(store, [_HELLO.format(r) for r in range(1, info.world_size)],
                   _STARTUP_TIMEOUT_S, check_alive)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timeout)
    _STORE = store
    set_tp(info.rank, info.world_size)
    return store


def get_store() -> dist.TCPStore:
    assert _STORE is not None, "init_distributed() first"
    return _STORE


def destroy_distributed() -> None:
    global _STORE, _CHECK_ALIVE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STORE = _CHECK_ALIVE = None
    set_tp(0, 1)
