"""ModelRunner: owns the model and the KV cache, turns scheduled sequences into tensors,
runs the forward pass and samples (seeds 000 and 002)."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from pagedllm.attention import cpu_paged, torch_native
from pagedllm.attention.context import get_context, reset_context, set_context
from pagedllm.config import EngineConfig
from pagedllm.engine.fault_injection import FaultInjector
from pagedllm.engine.scheduler import ScheduledBatch
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.swap import allocate_swap_tensor
from pagedllm.layers.sampler import (Penalties, SamplerOutput, SamplingBatch, compute_logprobs,
                                     sample)
from pagedllm.models.config import ModelConfig
from pagedllm.models.registry import model_class

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


def attention_backend():
    """The C++ paged-attention kernel when it builds, else the pure-PyTorch reference."""
    return cpu_paged.attention if cpu_paged.is_available() else torch_native.attention


class ModelRunner:
    faults: FaultInjector | None = None  # test-only, see engine/fault_injection.py

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: "object") -> None:
        self.config = config
        self.model_config = model_config
        self.block_size = config.block_size
        self.dtype = config.torch_dtype
        self.generator = torch.Generator().manual_seed(config.seed)
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)

        t = time.perf_counter()
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            self.model = model_class(model_config)(model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(weights)  # type: ignore[attr-defined]
        self.model.eval()
        logger.info("loaded %s (%s, %d layers) in %.1f s", model_config.name or model_config.architecture,
                    str(self.dtype).removeprefix("torch."), model_config.num_hidden_layers,
                    time.perf_counter() - t)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.num_swap_blocks = self.allocate_swap_space()

    # ---- KV cache -----------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        mc = self.model_config
        return (2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads
                * mc.head_dim * self.dtype.itemsize)

    def allocate_kv_cache(self) -> int:
        """One tensor [2, layers, blocks, block_size, kv_heads, head_dim] within the budget."""
        cfg, mc = self.config, self.model_config
        if cfg.kv_cache_memory_bytes is not None:
            budget, source = cfg.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        else:
            budget = int(available_memory_bytes() * cfg.kv_cache_memory_fraction)
            source = f"{cfg.kv_cache_memory_fraction:.0%} of available RAM"
        block_bytes = self.kv_block_bytes()
        num_blocks = budget // block_bytes
        # More than every sequence at full length can use is wasted memory.
        blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        num_blocks = min(num_blocks, cfg.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes ({source}) is smaller than one "
                             f"block of {block_bytes} bytes; raise the budget or lower block_size")
        # Zeroed, not empty: attention reads padded / masked slots too, and a NaN left in
        # uninitialised memory survives a zero softmax weight (0 * NaN = NaN).
        self.kv_cache = torch.zeros(2, mc.num_hidden_layers, num_blocks, self.block_size,
                                    mc.num_key_value_heads, mc.head_dim, dtype=self.dtype)
        impl = attention_backend()
        layer = 0
        for module in self.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                module.k_cache = self.kv_cache[0, layer]
                module.v_cache = self.kv_cache[1, layer]
                module.impl = impl
                layer += 1
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB (budget: %s)",
                    num_blocks, self.block_size, num_blocks * self.block_size,
                    num_blocks * block_bytes / 2**20, source)
        return num_blocks

    def allocate_swap_space(self) -> int:
        """The second-tier pool for swap preemption (engine/swap.py); none for recompute."""
        cfg = self.config
        if cfg.preemption_mode != "swap":
            self.swap_cache = None
            return 0
        num_blocks = int(cfg.swap_space * 2**30) // self.kv_block_bytes()
        if num_blocks < 1:
            raise ValueError(f"swap_space of {cfg.swap_space} GiB is smaller than one KV block "
                             f"({self.kv_block_bytes()} bytes)")
        shape = (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:])
        self.swap_cache = allocate_swap_tensor(shape, self.dtype, self.kv_cache.device)
        where = "memory-mapped file" if self.kv_cache.device.type == "cpu" else "host memory"
        logger.info("swap space: %d blocks, %.1f MiB (%s)", num_blocks,
                    num_blocks * self.kv_block_bytes() / 2**20, where)
        return num_blocks

    # ---- input preparation ----------------------------------------------------------------

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        return torch.from_numpy(tables)

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
        block_tables = self._block_tables(seqs)
        pos = torch.tensor(positions, dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(seqlens_q))
        slot_mapping = block_tables[rows, pos // bs] * bs + pos % bs
        set_context(
            is_prefill=num_decodes < len(seqs), num_decodes=num_decodes,
            cu_seqlens_q=torch.tensor(np.cumsum([0] + seqlens_q)),
            cu_seqlens_k=torch.tensor(np.cumsum([0] + seqlens_k)),
            max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
            slot_mapping=slot_mapping,
            context_lens=torch.tensor(seqlens_k[:num_decodes], dtype=torch.int64),
            block_tables=block_tables, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
        return torch.tensor(input_ids, dtype=torch.int64), pos

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

    def move_blocks(self, batch: ScheduledBatch) -> None:
        """Before the forward pass: swap out, swap in, then copy on write (whole blocks,
        every layer, K and V). Out first: a block freed by a swap-out may be reused below."""
        if batch.blocks_to_swap_out:
            assert self.swap_cache is not None
            src, dst = _ids(batch.blocks_to_swap_out)
            self.swap_cache[:, :, dst] = self.kv_cache[:, :, src].to(self.swap_cache.device)
        if batch.blocks_to_swap_in:
            assert self.swap_cache is not None
            src, dst = _ids(batch.blocks_to_swap_in)
            self.kv_cache[:, :, dst] = self.swap_cache[:, :, src].to(self.kv_cache.device)
        if batch.blocks_to_copy:
            src, dst = _ids(batch.blocks_to_copy)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, eos_token_ids: list[int]) -> SamplerOutput:
        """Compute the batch's tokens; sample one token id (and its logprobs, if asked) per
        batch.samplers entry. move_blocks(batch) must have run first."""
        input_ids, positions = self.prepare_inputs(batch.seqs, batch.num_new_tokens)
        try:
            hidden = self.model(input_ids, positions)
            if not batch.samplers:
                return SamplerOutput([])
            last = get_context().cu_seqlens_q[1:] - 1  # each row's last token
            rows = torch.tensor([row for _, row in batch.samplers])
            logits = self.model.compute_logits(hidden[last[rows]])  # type: ignore[attr-defined]
        finally:
            reset_context()
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


def _ids(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst = zip(*pairs)
    return torch.tensor(src), torch.tensor(dst)
