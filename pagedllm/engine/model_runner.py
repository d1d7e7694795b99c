"""ModelRunner: owns the model shard and the KV cache of one rank, turns scheduled sequences
into tensors, runs the forward pass and samples (seeds 000 and 002).

With tensor parallelism rank 0's runner also starts the other ranks (engine/workers.py)
and publishes each step's inputs to them; their runners only execute the model.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import fields
from typing import Callable, TypeVar

import numpy as np
import torch

from pagedllm import memory
from pagedllm.attention.context import get_context, reset_context, set_context
from pagedllm.attention.dispatch import load_backend, resolve_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed import (DistInfo, all_gather_str, all_reduce_min, destroy_distributed,
                                  free_port, get_store, init_distributed, torchrun_env)
from pagedllm.engine.fault_injection import FaultInjector
from pagedllm.engine.scheduler import ScheduledBatch
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.swap import allocate_swap_tensor
from pagedllm.engine.workers import (BlockMoves, StepChannel, StepInputs, TensorParallelError,
                                     WorkerProcesses, acknowledge_exit, default_num_threads,
                                     sigint_deferred)
from pagedllm.layers.linear import LinearBase, PrepackedWeight, is_packed_for_pagedllm
from pagedllm.layers.quantized import attach_q4_1
from pagedllm.layers.sampler import (Penalties, SamplerOutput, SamplingBatch, compute_logprobs,
                                     sample)
from pagedllm.models.config import ModelConfig
from pagedllm.models.registry import model_class

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


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


class ModelRunner:
    faults: FaultInjector | None = None  # test-only, see engine/fault_injection.py

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: "object", dist_info: DistInfo | None = None,
                 q4_1_weights: "object | None" = None) -> None:
        """dist_info is given to ranks > 0; rank 0 works it out (and spawns the others).
        q4_1_weights (quantization="gguf"): ModelSource.q4_1_weights(), kept quantized."""
        self.config = config
        self.model_config = model_config
        self.block_size = config.block_size
        self.dtype = config.torch_dtype
        self.generator = torch.Generator().manual_seed(config.seed)
        self.world_size = config.tensor_parallel_size
        self.workers: WorkerProcesses | None = None
        self.rank = dist_info.rank if dist_info is not None else 0
        self.broken = False
        self._shut_down = False
        info = dist_info or DistInfo(0, 1, 0, 1, "", 0)
        if self.world_size > 1:
            info = self._join_group(dist_info)
        self.rank = info.rank
        self.dist_info = info
        torch.set_num_threads(config.num_threads or default_num_threads(info.local_world_size))
        self.device = self._select_device(info)
        self.graphs = None
        try:
            if self.world_size > 1:
                self._check_same_dtype()
            self._build_model(weights, q4_1_weights)
            self.num_kvcache_blocks = self.allocate_kv_cache()
            self.num_swap_blocks = self.allocate_swap_space()
            if (self.device.type == "cuda" and not config.enforce_eager
                    and self.attention_backend in ("triton", "flash")):
                self.graphs = self._capture_decode_graphs()
        except BaseException as e:
            # A worker that died while loading shows up here as a failed collective.
            error = (self.workers.failure(e, "start-up") if self.workers is not None
                     and isinstance(e, RuntimeError) else None)
            self.broken = True
            self.shutdown()
            if error is not None:
                raise error from e
            raise

    def _join_group(self, dist_info: DistInfo | None) -> DistInfo:
        cfg = self.config
        spawn = False
        if dist_info is None:
            dist_info, spawn = rank0_dist_info(self.world_size)
            self.workers = WorkerProcesses(cfg, dist_info, spawn)
            atexit.register(self.shutdown)
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        check_alive = self.workers.check_alive if self.workers is not None else None
        try:
            init_distributed(dist_info, backend, cfg.distributed_timeout_seconds, check_alive)
        except BaseException as e:
            if self.workers is not None:
                self.broken = True
                self.shutdown()
                if isinstance(e, TensorParallelError):
                    raise
                raise TensorParallelError(f"tensor-parallel rendezvous at {dist_info.master_addr}:"
                                          f"{dist_info.master_port} failed: {e}") from e
            raise
        self.channel = StepChannel(get_store())
        logger.info("tensor parallel: rank %d of %d joined (%s)", dist_info.rank,
                    dist_info.world_size, backend)
        return dist_info

    def _check_same_dtype(self) -> None:
        """Spawned ranks get rank 0's resolved dtype; ranks started separately (torchrun)
        resolve dtype='auto' each for its own CPU, and must not disagree."""
        dtypes = all_gather_str("dtype", str(self.dtype).removeprefix("torch."))
        if len(set(dtypes)) > 1:
            raise ValueError(f"tensor-parallel ranks chose different dtypes {dtypes} (in rank "
                             "order); pass --dtype explicitly")

    def _select_device(self, info: DistInfo) -> torch.device:
        if self.config.device != "cuda":
            return torch.device("cpu")
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        return device

    def _capture_decode_graphs(self) -> "object":
        from pagedllm.engine.cuda_graph import DecodeGraphs  # CUDA only
        cfg, mc = self.config, self.model_config
        return DecodeGraphs(self.model, cfg.max_num_seqs, -(-cfg.max_model_len // self.block_size),
                            mc.hidden_size, self.device, self.dtype)

    def _build_model(self, weights: "object", q4_1_weights: "object | None" = None) -> None:
        mc = self.model_config
        t = time.perf_counter()
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            if self.device.type == "cpu":
                self.model = model_class(mc)(mc)
            else:
                with self.device:
                    self.model = model_class(mc)(mc)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(weights)  # type: ignore[attr-defined]
        self.model.eval()
        packed = sum(m.prepack() for m in self.model.modules() if isinstance(m, PrepackedWeight))
        prepacked = [m for m in self.model.modules()
                     if isinstance(m, PrepackedWeight) and m.packed_weight is not None]
        ours = [m.packed_weight for m in prepacked if is_packed_for_pagedllm(m.packed_weight)]
        if packed and self.rank == 0:
            logger.info("weights also kept packed for bf16 matmuls (%d for pagedllm's kernel, "
                        "%d for oneDNN): +%.0f MiB", len(ours), len(prepacked) - len(ours),
                        packed / 2**20)
        if q4_1_weights is not None:
            self._keep_q4_1(q4_1_weights)
            prepacked = [m for m in self.model.modules()
                         if isinstance(m, PrepackedWeight) and m.packed_weight is not None]
            ours = [m.packed_weight for m in prepacked if is_packed_for_pagedllm(m.packed_weight)]
        if self.device.type == "cpu":
            moved = memory.move_to_huge_pages(list(self.model.parameters()) + ours)
            # oneDNN's packed copies (opaque tensors) hold as many bytes as the weights
            moved += memory.collapse_to_huge_pages(
                [(torch.ops.mkldnn.data_ptr(m.packed_weight), m.weight.nbytes)
                 for m in prepacked if not is_packed_for_pagedllm(m.packed_weight)])
            if moved and self.rank == 0:
                logger.info("weights on 2 MiB pages: %.0f MiB", moved / 2**20)
        self.attention_backend = resolve_backend(self.config.attention_backend, self.device.type,
                                                 self.block_size, self.dtype)
        impl = load_backend(self.attention_backend).attention
        for module in self.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "impl"):
                module.impl = impl
        if self.rank == 0:
            logger.info("loaded %s (%s, %d layers) in %.1f s; attention backend: %s",
                        mc.name or mc.architecture, str(self.dtype).removeprefix("torch."),
                        mc.num_hidden_layers, time.perf_counter() - t, self.attention_backend)

    def _keep_q4_1(self, q4_1_weights: "object") -> None:
        """quantization="gguf": the linears whose GGUF weights are Q4_1 take them packed for
        the Q4_1 kernel instead of their bf16 weights."""
        from pagedllm.cpu_ops import load
        ext = load()
        if self.device.type != "cpu" or ext is None or not ext.has_packed_linear_bf16():
            raise ValueError("quantization=gguf needs the CPU kernels built with AVX512-BF16 "
                             "(this CPU or build has none)")
        before = {m: m.packed_weight for m in self.model.modules() if isinstance(m, LinearBase)}
        changed = attach_q4_1(self.model, q4_1_weights)  # type: ignore[arg-type]
        if not changed:
            raise ValueError("quantization=gguf: the model has no Q4_1 linear weights to keep "
                             "(only GGUF Q4_1 is kept quantized; other types are dequantized)")
        added = sum(m.packed_weight.nbytes for m in changed)
        # their bf16 weights and bf16 packings are no longer read: freed (the weight an empty
        # tensor of its dtype; linear() and decode_layers take the Q4_1 packing first)
        freed = sum(m.weight.nbytes * (2 if before[m] is not None else 1) for m in changed)
        for m in changed:
            m.weight.data = torch.empty(0, dtype=m.weight.dtype)
        # The bf16 LM head on pagedllm's packed kernel everywhere (with AMX it was packed for
        # oneDNN): its fp32 logits, and the same kernel as on CPUs without AMX
        head = getattr(self.model, "lm_head", None)
        if (isinstance(head, PrepackedWeight) and head.weight.dtype == torch.bfloat16
                and not is_packed_for_pagedllm(head.packed_weight)
                and head.weight.shape[0] % 16 == 0 and head.weight.shape[1] % 2 == 0):
            head.packed_weight = ext.pack_linear_weight_bf16(head.weight.detach())
        if self.rank == 0:
            logger.info("quantization gguf: %d of %d linears keep their Q4_1 weights (%.0f MiB, "
                        "%.0f MiB of bf16 copies freed; the others stay %s)", len(changed),
                        len(before), added / 2**20, freed / 2**20,
                        str(self.dtype).removeprefix("torch."))

    # ---- KV cache -----------------------------------------------------------------------------

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank holds: its share, or one replica when there are fewer heads
        than ranks."""
        return max(1, self.model_config.num_key_value_heads // self.world_size)

    def kv_block_bytes(self) -> int:
        mc = self.model_config
        return (2 * mc.num_hidden_layers * self.block_size * self.num_local_kv_heads
                * mc.head_dim * self.dtype.itemsize)

    def kv_budget(self) -> tuple[int, str]:
        """This rank's KV-cache bytes: an explicit budget is split among the ranks, a
        fraction of RAM among the ranks that share this machine."""
        cfg, info = self.config, self.dist_info
        if cfg.kv_cache_memory_bytes is not None:
            return cfg.kv_cache_memory_bytes // self.world_size, "--kv-cache-memory-bytes"
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * cfg.kv_cache_memory_fraction), \
                f"{cfg.kv_cache_memory_fraction:.0%} of free GPU memory"
        budget = int(available_memory_bytes() * cfg.kv_cache_memory_fraction)
        return budget // info.local_world_size, f"{cfg.kv_cache_memory_fraction:.0%} of available RAM"

    def allocate_kv_cache(self) -> int:
        """One tensor [2, layers, blocks, block_size, local kv_heads, head_dim] within the
        budget; every rank takes the smallest block count any rank can hold."""
        cfg, mc = self.config, self.model_config
        budget, source = self.kv_budget()
        block_bytes = self.kv_block_bytes()
        num_blocks = budget // block_bytes
        # More than every sequence at full length can use is wasted memory.
        blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        num_blocks = all_reduce_min(min(num_blocks, cfg.max_num_seqs * blocks_per_seq))
        if num_blocks < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes ({source}) is smaller than one "
                             f"block of {block_bytes} bytes; raise the budget or lower block_size")
        # Zeroed, not empty: attention reads padded / masked slots too, and a NaN left in
        # uninitialised memory survives a zero softmax weight (0 * NaN = NaN).
        shape = (2, mc.num_hidden_layers, num_blocks, self.block_size, self.num_local_kv_heads,
                 mc.head_dim)
        self.kv_cache = (memory.zeros(shape, self.dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=self.dtype, device=self.device))
        layer = 0
        for module in self.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                module.k_cache = self.kv_cache[0, layer]
                module.v_cache = self.kv_cache[1, layer]
                layer += 1
        if self.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB%s%s (budget: %s)",
                        num_blocks, self.block_size, num_blocks * self.block_size,
                        num_blocks * block_bytes / 2**20,
                        " per rank" if self.world_size > 1 else "",
                        " on 2 MiB pages" if self.device.type == "cpu"
                        and memory.huge_pages_available() else "", source)
        return num_blocks

    def allocate_swap_space(self) -> int:
        """The second-tier pool for swap preemption (engine/swap.py); none for recompute.
        With tensor parallelism each rank holds its share of swap_space for its KV shard
        (its own memory-mapped file); the block count is the same on every rank, as
        config and block size are."""
        cfg = self.config
        if cfg.preemption_mode != "swap":
            self.swap_cache = None
            return 0
        block_bytes = self.kv_block_bytes()
        num_blocks = int(cfg.swap_space * 2**30) // self.world_size // block_bytes
        if num_blocks < 1:
            raise ValueError(f"swap_space of {cfg.swap_space} GiB is smaller than one KV block "
                             f"({block_bytes * self.world_size} bytes)")
        shape = (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:])
        self.swap_cache = allocate_swap_tensor(shape, self.dtype, self.kv_cache.device)
        where = "memory-mapped file" if self.kv_cache.device.type == "cpu" else "host memory"
        if self.rank == 0:
            logger.info("swap space: %d blocks, %.1f MiB%s (%s)", num_blocks,
                        num_blocks * block_bytes / 2**20,
                        " per rank" if self.world_size > 1 else "", where)
        return num_blocks

    # ---- input preparation ----------------------------------------------------------------

    def _block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        return tables

    def prepare_inputs(self, seqs: list[Sequence], num_new_tokens: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and positions of one step; sets the attention Context.

        Row i computes tokens [num_computed_tokens, num_computed_tokens + num_new_tokens[i])
        of seqs[i] and attends to every token before them, so its key length is
        num_computed_tokens + num_new_tokens[i] (cached prefix + earlier chunks + this
        chunk; nano-vllm #212 used the chunk alone). Rows with one new token (decodes) must
        come first.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seqlens_q: list[int] = []
        seqlens_k: list[int] = []
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            seqlens_q.append(n)
            seqlens_k.append(start + n)
        num_decodes = next((i for i, n in enumerate(seqlens_q) if n != 1), len(seqlens_q))
        assert all(n != 1 for n in seqlens_q[num_decodes:]), "decode rows must come first"
        # Index arithmetic in numpy: torch's small-tensor ops cost ~0.3 ms more per step.
        block_tables = self._block_tables(seqs)
        pos = np.array(positions, dtype=np.int64)
        rows = np.repeat(np.arange(len(seqs)), seqlens_q)
        slot_mapping = block_tables[rows, pos // bs] * bs + pos % bs
        set_context(
            is_prefill=num_decodes < len(seqs), num_decodes=num_decodes,
            cu_seqlens_q=torch.from_numpy(np.cumsum([0] + seqlens_q)),
            cu_seqlens_k=torch.from_numpy(np.cumsum([0] + seqlens_k)),
            max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
            slot_mapping=torch.from_numpy(slot_mapping),
            context_lens=torch.tensor(seqlens_k[:num_decodes], dtype=torch.int64),
            block_tables=torch.from_numpy(block_tables), seqlens_q=seqlens_q,
            seqlens_k=seqlens_k)
        return torch.tensor(input_ids, dtype=torch.int64), torch.from_numpy(pos)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs computing every not yet computed token of each sequence (prompts)."""
        return self.prepare_inputs(seqs, [seq.num_uncomputed_tokens for seq in seqs])

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs computing the newest token of each sequence."""
        return self.prepare_inputs(seqs, [1] * len(seqs))

    def prepare_sample(self, seqs: list[Sequence], eos_token_ids: list[int]) -> SamplingBatch:
        params = [seq.sampling_params for seq in seqs]
        vocab = self.model_config.vocab_size
        banned = []
        for row, (seq, sp) in enumerate(zip(seqs, params)):
            if seq.num_completion_tokens < sp.min_tokens:
                banned.append((row, [*(() if sp.ignore_eos else eos_token_ids), *sp.stop_token_ids]))
        penalties = self.prepare_penalties(seqs) if any(sp.has_penalties for sp in params) else None
        num_logprobs = ([sp.logprobs for sp in params]
                        if any(sp.logprobs is not None for sp in params) else None)
        all_greedy = all(sp.temperature == 0 for sp in params)
        if all_greedy:
            return SamplingBatch(torch.zeros(len(seqs)), None, None, None, [], True, banned,
                                 penalties, num_logprobs)
        top_ks = [sp.top_k if sp.top_k > 0 else vocab for sp in params]
        top_ps = [sp.top_p for sp in params]
        min_ps = [sp.min_p for sp in params]
        return SamplingBatch(
            temperatures=torch.tensor([sp.temperature for sp in params], dtype=torch.float32),
            top_ks=torch.tensor(top_ks) if any(k < vocab for k in top_ks) else None,
            top_ps=torch.tensor(top_ps) if any(p < 1 for p in top_ps) else None,
            min_ps=torch.tensor(min_ps) if any(p > 0 for p in min_ps) else None,
            generators=[seq.generator for seq in seqs],
            all_greedy=False, banned=banned, penalties=penalties, num_logprobs=num_logprobs)

    def prepare_penalties(self, seqs: list[Sequence]) -> Penalties:
        """Token counts of each row's output and a mask of its prompt (rows without penalties
        stay zero and get neutral factors)."""
        vocab = self.model_config.vocab_size
        output_counts = torch.zeros(len(seqs), vocab)
        prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool)
        for row, seq in enumerate(seqs):
            if not seq.sampling_params.has_penalties:
                continue
            output = torch.tensor(seq.completion_token_ids, dtype=torch.int64)
            output_counts[row].index_add_(0, output, torch.ones(len(output)))
            prompt_mask[row, torch.tensor(seq.prompt_token_ids, dtype=torch.int64)] = True
        params = [seq.sampling_params for seq in seqs]
        return Penalties(
            repetition=torch.tensor([sp.repetition_penalty for sp in params], dtype=torch.float32),
            frequency=torch.tensor([sp.frequency_penalty for sp in params], dtype=torch.float32),
            presence=torch.tensor([sp.presence_penalty for sp in params], dtype=torch.float32),
            output_counts=output_counts, prompt_mask=prompt_mask)

    # ---- the step ---------------------------------------------------------------------------

    def move_blocks(self, batch: ScheduledBatch | BlockMoves) -> None:
        """Before the forward pass: swap out, swap in, then copy on write (whole blocks,
        every layer, K and V). Out first: a block freed by a swap-out may be reused below.
        With tensor parallelism rank 0 first tells the other ranks to move the same blocks
        of their shards."""
        if self.world_size > 1 and self.rank == 0:
            moves = BlockMoves(batch.blocks_to_swap_out, batch.blocks_to_swap_in,
                               batch.blocks_to_copy)
            def step() -> None:
                self.channel.publish(moves)
                self._move_blocks(moves)
            self._in_step(step)
        else:
            self._move_blocks(batch)

    def _move_blocks(self, moves: ScheduledBatch | BlockMoves) -> None:
        if moves.blocks_to_swap_out:
            assert self.swap_cache is not None
            src, dst = _ids(moves.blocks_to_swap_out)
            self.swap_cache[:, :, dst] = self.kv_cache[:, :, src].to(self.swap_cache.device)
        if moves.blocks_to_swap_in:
            assert self.swap_cache is not None
            src, dst = _ids(moves.blocks_to_swap_in)
            self.kv_cache[:, :, dst] = self.swap_cache[:, :, src].to(self.kv_cache.device)
        if moves.blocks_to_copy:
            src, dst = _ids(moves.blocks_to_copy)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, eos_token_ids: list[int]) -> SamplerOutput:
        """Compute the batch's tokens; sample one token id (and its logprobs, if asked) per
        batch.samplers entry. move_blocks(batch) must have run first."""
        input_ids, positions = self.prepare_inputs(batch.seqs, batch.num_new_tokens)
        try:
            if self.world_size > 1:
                logits = self._run_parallel(input_ids, positions, batch)
            else:
                logits = self.execute_model(input_ids, positions, _logit_rows(batch))
        finally:
            reset_context()
        if logits is None:  # nothing to sample (every row is a prompt chunk)
            return SamplerOutput([])
        if self.device.type != "cpu":  # the sampler and its generators live on the host
            logits = logits.cpu()
        self.beam_logprobs(batch, logits)
        sampling = self.prepare_sample(batch.sampled_seqs, eos_token_ids)
        if self.faults is not None:
            self.faults.check("sampler", batch.sampled_seqs)
        token_ids = sample(logits, sampling, self.generator)
        logprobs = (compute_logprobs(logits, sampling, token_ids)
                    if sampling.num_logprobs is not None else None)
        return SamplerOutput(token_ids.tolist(), logprobs)

    @staticmethod
    def beam_logprobs(batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Beams are not sampled: give each its next-token log-probabilities (fp32)."""
        rows = [i for i, (seq, _) in enumerate(batch.samplers) if seq.is_beam]
        if rows:
            logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
            for i, lp in zip(rows, logprobs):
                batch.samplers[i][0].beam_logprobs = lp

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      logit_rows: torch.Tensor) -> torch.Tensor | None:
        """Forward pass of this rank under the current Context; logits of the tokens
        logit_rows indexes (None when it is empty, and on ranks > 0, which only contribute
        their shard of the vocabulary)."""
        if self.device.type != "cpu":
            input_ids, positions = self._to_device(input_ids, positions)
        ctx = get_context()
        if (self.graphs is not None and not ctx.is_prefill
                and input_ids.numel() <= self.graphs.max_batch_size):
            hidden = self.graphs.run(input_ids, positions, ctx)
        elif self._keeps_rows(logit_rows, input_ids.numel()):
            # only the sampled tokens' hidden states (the model skips the others' last layer)
            hidden = self.model(input_ids, positions, keep_rows=logit_rows.to(input_ids.device))
            return self.model.compute_logits(hidden)  # type: ignore[attr-defined]
        else:
            hidden = self.model(input_ids, positions)
        if not logit_rows.numel():
            return None
        hidden = hidden[logit_rows.to(hidden.device)]
        return self.model.compute_logits(hidden)  # type: ignore[attr-defined]

    def _keeps_rows(self, logit_rows: torch.Tensor, num_tokens: int) -> bool:
        """Whether the forward computes only the logit rows' last layer: where the model can
        (computes_kept_rows), the rows are fewer than the tokens (prompts) and the dtype is
        not fp32, whose greedy outputs stay those of HF transformers bit for bit (its last
        layer's matmuls run over every prompt token: fewer rows can take another kernel, and
        round differently; bf16 and fp16 are held to closeness)."""
        return (0 < logit_rows.numel() < num_tokens and self.dtype != torch.float32
                and getattr(self.model, "computes_kept_rows", False))

    def _to_device(self, input_ids: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = get_context()
        moved = {f.name: getattr(ctx, f.name) for f in fields(ctx)}
        set_context(**{k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor)
                           else v) for k, v in moved.items()})
        return (input_ids.to(self.device, non_blocking=True),
                positions.to(self.device, non_blocking=True))

    # ---- tensor parallelism -------------------------------------------------------------------

    def _run_parallel(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: ScheduledBatch) -> torch.Tensor | None:
        """Rank 0: publish the step, run its shard with the others, get the gathered logits."""
        def step() -> torch.Tensor | None:
            logit_rows = _logit_rows(batch)
            self.channel.publish(StepInputs(input_ids, positions, get_context(), logit_rows))
            return self.execute_model(input_ids, positions, logit_rows)
        return self._in_step(step)

    def _in_step(self, fn: Callable[[], _T]) -> _T:
        """Rank 0: run fn, which publishes a step and takes part in it. Any failure here
        leaves the ranks out of step, so it is fatal."""
        if self.broken:
            raise TensorParallelError("a previous tensor-parallel step failed; restart the engine")
        if self.workers is not None:
            self.workers.check_alive()
        with sigint_deferred():
            try:
                return fn()
            except Exception as e:
                self.broken = True
                raise (self.workers.failure(e) if self.workers is not None
                       else TensorParallelError(f"tensor-parallel step failed: {e}")) from e

    @torch.inference_mode()
    def worker_loop(self) -> None:
        """Ranks > 0: run every step rank 0 publishes until it says EXIT."""
        try:
            while (step := self.channel.receive()) is not None:
                if isinstance(step, BlockMoves):
                    self._move_blocks(step)
                    continue
                set_context(**vars(step.context))
                try:
                    self.execute_model(step.input_ids, step.positions, step.logit_rows)
                finally:
                    reset_context()
            acknowledge_exit(self.channel.store, self.rank)
        except Exception as e:
            logger.error("rank %d: lost the tensor-parallel group (%s: %s); exiting",
                         self.rank, type(e).__name__, e)
            raise SystemExit(1) from None
        finally:
            destroy_distributed()

    def shutdown(self) -> None:
        """Rank 0: tell the workers to exit and reap them (terminate any that hang).
        Idempotent; also runs at interpreter exit."""
        if self._shut_down or self.world_size == 1 or self.rank != 0:
            return
        self._shut_down = True
        workers = self.workers
        graceful = not self.broken and workers is not None and not workers.dead()
        if graceful and hasattr(self, "channel"):
            try:
                self.channel.publish(None)
            except Exception as e:  # the store is gone: nothing more to say to anyone
                logger.warning("could not tell the workers to exit: %s", e)
                graceful = False
        if workers is not None:
            if workers.procs:
                workers.join(10.0 if graceful else 0.0)
            elif graceful and hasattr(self, "channel"):
                workers.wait_for_acks(self.channel.store, 10.0)
        destroy_distributed()
        atexit.unregister(self.shutdown)
        logger.info("tensor parallel: workers stopped")


def _logit_rows(batch: ScheduledBatch) -> torch.Tensor:
    """Index of the token whose logits each batch.samplers entry samples from (a row's last
    token; a row sampled by several forks appears once per fork). Needs the Context."""
    last = get_context().cu_seqlens_q[1:] - 1
    return last[torch.tensor([row for _, row in batch.samplers], dtype=torch.int64)]


def _ids(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst = zip(*pairs)
    return torch.tensor(src), torch.tensor(dst)
