"""The KV cache of one rank: its budget, its one preallocated tensor of blocks, the views
each attention layer reads, and the swap space of swap preemption (engine/swap.py)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm import memory
from pagedllm.attention import kv_quant
from pagedllm.config import EngineConfig
from pagedllm.distributed import all_reduce_min
from pagedllm.engine.swap import allocate_swap_tensor
from pagedllm.models.config import ModelConfig
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class KVCacheShape:
    """What one rank's KV blocks hold: every layer's K and V of block_size tokens for the
    KV heads this rank holds (its share, or one replica when there are fewer heads than
    ranks)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @staticmethod
    def of(config: EngineConfig, mc: ModelConfig) -> KVCacheShape:
        kv_heads = max(1, mc.num_key_value_heads // config.tensor_parallel_size)
        return KVCacheShape(mc.num_hidden_layers, config.block_size, kv_heads, mc.head_dim,
                            config.kv_cache_torch_dtype)

    @property
    def vector_elements(self) -> int:
        """Elements of one token's head vector: head_dim, or for an int8 cache head_dim
        values and their fp32 scale (attention/kv_quant.py)."""
        return self.head_dim + (kv_quant.SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def block_bytes(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads
                * self.vector_elements * self.dtype.itemsize)

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[2 (K, V), layers, blocks, block_size, kv_heads, head_dim (+ 4 for int8)]."""
        return (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                self.vector_elements)


@dataclass(frozen=True)
class GpuProfile:
    """A GPU's memory after the model loaded and a profiled warm-up step ran (the model
    runner's _profile_peak_activations): bytes in use on the device (weights, CUDA context,
    other processes; the warm-up's cached blocks released), the warm-up's peak activation
    bytes and its token count, and the model's own weight bytes (for the log)."""

    total: int
    used: int
    peak_activations: int
    num_tokens: int
    weights: int

    def kv_bytes(self, utilization: float) -> int:
        """vLLM's rule: utilization x the device's memory, less what is in use and the peak
        a step's activations reach."""
        return int(self.total * utilization) - self.used - self.peak_activations

    def describe(self, utilization: float) -> str:
        gib = 2**30
        return (f"{utilization:.0%} of {self.total / gib:.1f} GiB GPU memory, less "
                f"{self.used / gib:.2f} GiB in use (weights {self.weights / gib:.2f} GiB) and "
                f"{self.peak_activations / gib:.2f} GiB peak activations of a "
                f"{self.num_tokens}-token step")


def gpu_available_bytes(device: torch.device, utilization: float) -> int:
    """What the engine may still take on a GPU: utilization x its memory, less what is in
    use (by this or any other process)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization) - (total - free)


def kv_budget(config: EngineConfig, device: torch.device, local_world_size: int,
              profile: GpuProfile | None = None) -> tuple[int, str]:
    """This rank's KV-cache bytes and where the figure comes from: an explicit budget is
    split among the ranks; on CUDA what the profiled warm-up leaves of
    gpu_memory_utilization; on the CPU a fraction of RAM among the ranks that share it."""
    if config.kv_cache_memory_bytes is not None:
        return (config.kv_cache_memory_bytes // config.tensor_parallel_size,
                "--kv-cache-memory-bytes")
    if device.type == "cuda":
        if profile is None:
            raise ValueError("a CUDA KV cache is sized from a profiled warm-up step")
        utilization = config.gpu_memory_utilization
        return profile.kv_bytes(utilization), profile.describe(utilization)
    fraction = config.kv_cache_memory_fraction
    budget = int(available_memory_bytes() * fraction)
    return budget // local_world_size, f"{fraction:.0%} of available RAM"


def allocate_kv_cache(config: EngineConfig, shape: KVCacheShape, device: torch.device,
                      local_world_size: int, log: bool, profile: GpuProfile | None = None
                      ) -> torch.Tensor:
    """One zeroed tensor of KV blocks within the budget; every rank takes the smallest block
    count any rank can hold, and never more than every sequence at full length can use."""
    budget, source = kv_budget(config, device, local_world_size, profile)
    num_blocks = budget // shape.block_bytes
    blocks_per_seq = cdiv(config.max_model_len, shape.block_size)
    num_blocks = all_reduce_min(min(num_blocks, config.max_num_seqs * blocks_per_seq))
    if num_blocks < 1:
        raise ValueError(f"KV-cache budget of {budget} bytes ({source}) is smaller than one "
                         f"block of {shape.block_bytes} bytes; raise the budget or lower "
                         "block_size")
    # Zeroed, not empty: attention reads padded / masked slots too, and a NaN left in
    # uninitialised memory survives a zero softmax weight (0 * NaN = NaN). On the CPU the
    # pages are committed as blocks are first written (an untouched page reads as zeros),
    # not at start unless kv_cache_populate: committing 25% of RAM took 3-15 s on a 2-core
    # VM (5.7 GB for SmolLM2: the kernel zeroing and compacting 2 MiB pages) where loading
    # the model took 0.2 s; the faults cost W1 on a Qwen3-0.6B file ~6% (docs/kernels.md).
    dims = shape.tensor_shape(num_blocks)
    cpu = device.type == "cpu"
    kv_cache = (memory.zeros(dims, shape.dtype, populate=config.kv_cache_populate) if cpu
                else torch.zeros(dims, dtype=shape.dtype, device=device))
    if log:
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB %s%s%s%s (budget: %s)",
                    num_blocks, shape.block_size, num_blocks * shape.block_size,
                    num_blocks * shape.block_bytes / 2**20, str(shape.dtype).removeprefix("torch."),
                    " per rank" if config.tensor_parallel_size > 1 else "",
                    " on 2 MiB pages" if cpu and memory.huge_pages_available() else "",
                    "" if not cpu else ", committed" if config.kv_cache_populate
                    else ", committed as written", source)
    return kv_cache


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor) -> None:
    """Point each attention layer, in order, at its layer's K and V blocks."""
    layer = 0
    for module in model.modules():
        if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
            module.k_cache = kv_cache[0, layer]
            module.v_cache = kv_cache[1, layer]
            layer += 1


def allocate_swap_space(config: EngineConfig, shape: KVCacheShape, kv_cache: torch.Tensor,
                        log: bool) -> torch.Tensor | None:
    """The second-tier pool for swap preemption (engine/swap.py); None for recompute.
    With tensor parallelism each rank holds its share of swap_space for its KV shard (its
    own memory-mapped file); the block count is the same on every rank, as config and block
    size are."""
    if config.preemption_mode != "swap":
        return None
    world_size = config.tensor_parallel_size
    num_blocks = int(config.swap_space * 2**30) // world_size // shape.block_bytes
    if num_blocks < 1:
        raise ValueError(f"swap_space of {config.swap_space} GiB is smaller than one KV block "
                         f"({shape.block_bytes * world_size} bytes)")
    swap_cache = allocate_swap_tensor(shape.tensor_shape(num_blocks), shape.dtype,
                                      kv_cache.device)
    if log:
        where = "memory-mapped file" if kv_cache.device.type == "cpu" else "host memory"
        logger.info("swap space: %d blocks, %.1f MiB%s (%s)", num_blocks,
                    num_blocks * shape.block_bytes / 2**20,
                    " per rank" if world_size > 1 else "", where)
    return swap_cache
