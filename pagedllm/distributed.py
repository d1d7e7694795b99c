"""Tensor-parallel rank and size of this process (1 process = rank 0 of 1)."""
from __future__ import annotations

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
