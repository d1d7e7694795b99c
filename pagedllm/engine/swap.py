"""The second-tier KV pool for swap preemption (seed 003, chapter 4).

A preempted sequence's blocks are copied here and copied back when it resumes, so its KV is
not recomputed. SwapPool keeps the accounting (which swap blocks are free); the tensor
that holds the data is allocated by the ModelRunner with allocate_swap_tensor: host memory
when the KV cache is on a GPU, a memory-mapped file on disk when it is on the CPU (host
memory is what the swap space must not compete with).
"""
from __future__ import annotations

import os
import tempfile

import torch


class SwapPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def take(self, n: int) -> list[int]:
        assert n <= len(self.free_block_ids), "swap space exhausted"
        return [self.free_block_ids.pop() for _ in range(n)]

    def release(self, block_ids: list[int]) -> None:
        self.free_block_ids.extend(reversed(block_ids))


def allocate_swap_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                         swap_dir: str | None = None) -> torch.Tensor:
    """A zeroed tensor for the swapped-out blocks (see the module docstring)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    numel = 1
    for d in shape:
        numel *= d
    fd, path = tempfile.mkstemp(prefix="pagedllm-swap-", suffix=".kv", dir=swap_dir)
    try:
        os.ftruncate(fd, numel * dtype.itemsize)   # sparse: zero-filled, no disk used yet
        storage = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)   # the mapping keeps the data; nothing is left behind on exit
    return storage.view(shape)
