"""ModelRunner: owns the model shard and the KV cache of one rank, turns scheduled sequences
into tensors, runs the forward pass and samples (seeds 000 and 002).

Each step runs on one of three executors: the model's forward, a replayed CUDA graph
(engine/cuda_graph.py) or the one-call CPU decode stack (engine/cpu_decode_stack.py).
With tensor parallelism rank 0's runner publishes each step's inputs to the other ranks
(engine/tp/), whose runners only execute the model.
"""
from __future__ import annotations

import atexit
import functools
import concurrent.futures
import logging
import time
from dataclasses import fields
from typing import Callable, Iterable, TypeVar

import numpy as np
import torch

from pagedllm import memory
from pagedllm.attention.context import get_context, reset_context, set_context
from pagedllm.attention.dispatch import load_backend, resolve_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed import (DistInfo, all_gather_str, destroy_distributed, get_store,
                                  init_distributed)
from pagedllm.engine.cpu_decode_stack import CpuDecodeStack
from pagedllm.engine.cuda_graph import DecodeGraphs, graph_blocker
from pagedllm.engine.fault_injection import FaultInjector
from pagedllm.engine.kv_cache import (GpuProfile, KVCacheShape, allocate_kv_cache,
                                      allocate_swap_space, bind_kv_cache)
from pagedllm.engine.scheduler import ScheduledBatch
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.spec_decode.positions import draft_positions
from pagedllm.engine.spec_decode.rejection_sampler import verify_greedy, verify_sampled
from pagedllm.engine.tp.errors import TensorParallelError
from pagedllm.engine.tp.processes import WorkerProcesses, default_num_threads, sigint_deferred
from pagedllm.engine.tp.protocol import BlockMoves, StepChannel, StepInputs
from pagedllm.layers.attention import Attention
from pagedllm.layers.quantized import GGUFWeight
from pagedllm.layers.sampler import (Penalties, SamplerOutput, SamplingBatch,
                                     apply_token_controls, apply_top_k_top_p_min_p,
                                     compute_logprobs, sample)
from pagedllm.layers.structured_output import draft_token_masks, fill_token_masks
from pagedllm.loader.model_loader import build_model, decode_read_bytes, linear_kernels
from pagedllm.models.config import ModelConfig
from pagedllm.outputs import TokenLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@functools.cache
def _read_bandwidth_gbs() -> float:
    from pagedllm.bench.hardware import memory_read_gbs
    return memory_read_gbs(256 * 2**20, min_seconds=0.2)


class ModelRunner:
    faults: FaultInjector | None = None  # test-only, see engine/fault_injection.py

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]],
                 dist_info: DistInfo | None = None,
                 workers: WorkerProcesses | None = None) -> None:
        """With tensor parallelism dist_info is this rank's place in the group, and rank 0
        gets the worker processes it started (engine/tp/processes.py; empty under
        torchrun). weights: ModelSource.weights(), GGUF weights kept quantized among them
        where quantization="gguf"."""
        self.config = config
        self.model_config = model_config
        self._masker: concurrent.futures.ThreadPoolExecutor | None = None  # grammar masks
        self.block_size = config.block_size
        self.dtype = config.torch_dtype
        self.world_size = config.tensor_parallel_size
        self.workers = workers
        self.broken = False
        self._shut_down = False
        info = dist_info or DistInfo(0, 1, 0, 1, "", 0)
        self.rank = info.rank
        self.dist_info = info
        if workers is not None:
            atexit.register(self.shutdown)
        if self.world_size > 1:
            self._join_group(info)
        torch.set_num_threads(config.num_threads or default_num_threads(info.local_world_size))
        self.device = self._select_device(info)
        # the sampler's shared generator, on the device where the sampler runs
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None
        self.decode_stack: CpuDecodeStack | None = None
        try:
            if self.world_size > 1:
                self._check_same_dtype()
            self._load_model(weights)
            self._allocate_kv_cache()
            self._choose_executors()
        except BaseException as e:
            # A worker that died while loading shows up here as a failed collective.
            error = (self.workers.failure(e, "start-up") if self.workers is not None
                     and isinstance(e, RuntimeError) else None)
            self.broken = True
            self.shutdown()
            if error is not None:
                raise error from e
            raise

    def _join_group(self, info: DistInfo) -> None:
        cfg = self.config
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        check_alive = self.workers.check_alive if self.workers is not None else None
        try:
            init_distributed(info, backend, cfg.distributed_timeout_seconds, check_alive)
        except BaseException as e:
            if self.workers is not None:
                self.broken = True
                self.shutdown()
                if isinstance(e, TensorParallelError):
                    raise
                raise TensorParallelError(f"tensor-parallel rendezvous at {info.master_addr}:"
                                          f"{info.master_port} failed: {e}") from e
            raise
        self.channel = StepChannel(get_store())
        logger.info("tensor parallel: rank %d of %d joined (%s)", info.rank,
                    info.world_size, backend)

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

    def _load_model(self, weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]]) -> None:
        mc = self.model_config
        t = time.perf_counter()
        self.model = build_model(mc, self.dtype, self.device, weights, log=self.rank == 0)
        self.attention_backend = resolve_backend(self.config.attention_backend, self.device.type,
                                                 self.block_size, self.dtype)
        backend = load_backend(self.attention_backend)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.bind_backend(backend)
        if self.rank == 0:
            logger.info("loaded %s (%s, %d layers) in %.1f s; attention backend: %s",
                        mc.name or mc.architecture, str(self.dtype).removeprefix("torch."),
                        mc.num_hidden_layers, time.perf_counter() - t, self.attention_backend)
            if self.device.type == "cpu" and logger.isEnabledFor(logging.INFO):
                self._log_decode_bound()

    def _log_decode_bound(self) -> None:
        """Which kernels the linears take, the weight bytes a decode token reads, and the
        single-stream speed that bounds at this machine's read bandwidth (measured once)."""
        nbytes = decode_read_bytes(self.model)
        gbs = _read_bandwidth_gbs()
        logger.info("linears: %s", linear_kernels(self.model))
        logger.info("a decode token reads %.0f MiB of weights: at %.0f GB/s (read bandwidth, "
                    "measured) one stream is bound at %.0f tok/s", nbytes / 2**20, gbs,
                    gbs * 1e9 / nbytes)

    def _allocate_kv_cache(self) -> None:
        self.kv_shape = KVCacheShape.of(self.config, self.model_config)
        log = self.rank == 0
        self.gpu_profile: GpuProfile | None = None
        if self.device.type == "cuda" and self.config.kv_cache_memory_bytes is None:
            self.gpu_profile = self._profile_peak_activations()
        self.kv_cache = allocate_kv_cache(self.config, self.kv_shape, self.device,
                                          self.dist_info.local_world_size, log, self.gpu_profile)
        bind_kv_cache(self.model, self.kv_cache)
        self.num_kvcache_blocks = self.kv_cache.shape[2]
        self.swap_cache = allocate_swap_space(self.config, self.kv_shape, self.kv_cache, log)
        self.num_swap_blocks = 0 if self.swap_cache is None else self.swap_cache.shape[2]

    @torch.inference_mode()
    def _profile_peak_activations(self) -> GpuProfile:
        """Run the largest step the scheduler can form, a prompt step of the full token budget
        (sequences of max_model_len tokens, at most max_num_seqs), with the logits and a
        sampler's sort of max_num_seqs rows, before the KV cache exists; return the device's
        memory figures and the step's peak activation bytes (vLLM's and nano-vllm's profile)."""
        cfg = self.config
        assert cfg.max_num_batched_tokens is not None and cfg.max_model_len is not None
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        lengths = [cfg.max_model_len] * (num_tokens // cfg.max_model_len)
        if num_tokens % cfg.max_model_len:
            lengths.append(num_tokens % cfg.max_model_len)
        one_block = torch.zeros(self.kv_shape.tensor_shape(1), dtype=self.kv_shape.dtype,
                                device=self.device)
        bind_kv_cache(self.model, one_block)  # (every slot below is -1: nothing is stored)
        cu = torch.tensor([0] + lengths).cumsum(0).to(self.device)
        set_context(is_prefill=True, num_decodes=0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                    slot_mapping=torch.full((num_tokens,), -1, device=self.device),
                    seqlens_q=lengths, seqlens_k=lengths)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        try:
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
            hidden = self.model(input_ids, positions)
            rows = hidden[-min(num_tokens, cfg.max_num_seqs):]
            logits = self.model.compute_logits(rows).float()  # type: ignore[operator]
            logits.softmax(-1).sort(-1, descending=True)   # top-p's sort, the sampler's peak
            torch.cuda.synchronize(self.device)
        finally:
            reset_context()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del one_block, hidden, rows, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return GpuProfile(total=total, used=total - free, peak_activations=peak,
                          num_tokens=num_tokens, weights=memory.resident_bytes(self.model))

    def _choose_executors(self) -> None:
        """Besides the model's forward: CUDA graphs of decode steps on CUDA, the one-call
        decode stack on the CPU; neither with enforce_eager."""
        cfg = self.config
        if cfg.enforce_eager:
            return
        if self.device.type == "cuda" and self.attention_backend in ("triton", "flash"):
            blocker = graph_blocker(self.model)
            if blocker is not None:
                logger.info("decode steps run eagerly, without CUDA graphs: %s", blocker)
                return
            t = time.perf_counter()
            self.graphs = DecodeGraphs(self.model, cfg.max_num_seqs,
                                       cdiv(cfg.max_model_len, self.block_size),
                                       self.model_config.hidden_size, self.device, self.dtype)
            if self.rank == 0:
                logger.info("CUDA graphs of decode steps for batch sizes %s captured in %.1f s",
                            self.graphs.batch_sizes, time.perf_counter() - t)
        elif self.device.type == "cpu" and self.attention_backend == "cpu_paged":
            self.decode_stack = CpuDecodeStack.for_model(self.model, self.dtype)

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
            if seq.spec_token_ids:  # a verified row: the last token, then the drafts
                input_ids.extend(seq.spec_token_ids)
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

    def _mask_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._masker is None:
            self._masker = concurrent.futures.ThreadPoolExecutor(1, "pagedllm-grammar")
        return self._masker

    def prepare_sample(self, seqs: list[Sequence], eos_token_ids: list[int],
                       grammar_masks: torch.Tensor | None = None) -> SamplingBatch:
        """The step's sampling options; grammar_masks: the masks of the rows with a grammar,
        in order, if computed already."""
        params = [seq.sampling_params for seq in seqs]
        vocab = self.model_config.vocab_size
        banned = []
        for row, (seq, sp) in enumerate(zip(seqs, params)):
            if seq.num_completion_tokens < sp.min_tokens and seq.grammar is None:
                # (a grammar decides where a structured output ends)
                banned.append((row, [*(() if sp.ignore_eos else eos_token_ids), *sp.stop_token_ids]))
            if seq.bad_words_token_ids:
                banned.extend((row, [ids[-1]]) for ids in _bad_words_due(seq))
        penalties = self.prepare_penalties(seqs) if any(sp.has_penalties for sp in params) else None
        num_logprobs = ([sp.logprobs for sp in params]
                        if any(sp.logprobs is not None for sp in params) else None)
        all_greedy = all(sp.temperature == 0 for sp in params)
        upload = self._upload
        if all_greedy:
            batch = SamplingBatch(torch.zeros(len(seqs), device=self.device), None, None, None,
                                  [], True, banned, penalties, num_logprobs)
        else:
            top_ks = [sp.top_k if sp.top_k > 0 else vocab for sp in params]
            top_ps = [sp.top_p for sp in params]
            min_ps = [sp.min_p for sp in params]
            batch = SamplingBatch(
                temperatures=upload([sp.temperature for sp in params], torch.float32),
                top_ks=upload(top_ks, torch.int64) if any(k < vocab for k in top_ks) else None,
                top_ps=upload(top_ps, torch.float32) if any(p < 1 for p in top_ps) else None,
                min_ps=upload(min_ps, torch.float32) if any(p > 0 for p in min_ps) else None,
                generators=[seq.generator for seq in seqs],
                all_greedy=False, banned=banned, penalties=penalties, num_logprobs=num_logprobs)
        for row, sp in enumerate(params):
            if sp.allowed_token_ids:
                batch.allowed.append((row, sp.allowed_token_ids))
            if sp.logit_bias:
                batch.bias.append((row, list(sp.logit_bias), list(sp.logit_bias.values())))
        batch.grammar_rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        if batch.grammar_rows:
            batch.grammar_masks = grammar_masks if grammar_masks is not None else fill_token_masks(
                [seqs[row].grammar for row in batch.grammar_rows], vocab)
        return batch

    def prepare_penalties(self, seqs: list[Sequence]) -> Penalties:
        """Token counts of each row's output and a mask of its prompt (rows without penalties
        stay zero and get neutral factors), built on the device from one upload of the
        (row, token) pairs."""
        vocab = self.model_config.vocab_size
        out_rows: list[int] = []
        out_ids: list[int] = []
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        for row, seq in enumerate(seqs):
            if not seq.sampling_params.has_penalties:
                continue
            output, prompt = seq.completion_token_ids, seq.prompt_token_ids
            out_rows += [row] * len(output)
            out_ids += output
            prompt_rows += [row] * len(prompt)
            prompt_ids += prompt
        output_counts = torch.zeros(len(seqs), vocab, device=self.device)
        output_counts.index_put_((self._upload(out_rows, torch.int64),
                                  self._upload(out_ids, torch.int64)),
                                 torch.ones(len(out_ids), device=self.device), accumulate=True)
        prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=self.device)
        prompt_mask[self._upload(prompt_rows, torch.int64), self._upload(prompt_ids, torch.int64)] = True
        params = [seq.sampling_params for seq in seqs]
        return Penalties(
            repetition=self._upload([sp.repetition_penalty for sp in params], torch.float32),
            frequency=self._upload([sp.frequency_penalty for sp in params], torch.float32),
            presence=self._upload([sp.presence_penalty for sp in params], torch.float32),
            output_counts=output_counts, prompt_mask=prompt_mask)

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the device: on CUDA through pinned memory, copied
        asynchronously (the step's kernels queue behind the copy, the host goes on)."""
        t = torch.tensor(values, dtype=dtype)
        return t if self.device.type == "cpu" else _pinned_upload(t, self.device)

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
                self.move_blocks_here(moves)
            self._in_step(step)
        else:
            self.move_blocks_here(batch)

    def move_blocks_here(self, moves: ScheduledBatch | BlockMoves) -> None:
        """Apply block moves to this rank's own KV shard and swap space."""
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
        batch.samplers entry; record prompt logprobs where asked; verify draft tokens (the
        accepted ones come back in SamplerOutput.accepted). move_blocks(batch) must have run
        first."""
        input_ids, positions = self.prepare_inputs(batch.seqs, batch.num_new_tokens)
        # grammar masks are computed beside the forward pass (llguidance drops the GIL)
        grammars = [seq.grammar for seq in batch.sampled_seqs if seq.grammar is not None]
        masks = (self._mask_thread().submit(fill_token_masks, grammars, self.model_config.vocab_size)
                 if grammars else None)
        try:
            targets = _prompt_logprob_targets(batch)
            verified = _verified_rows(batch)
            logit_rows = _logit_rows(batch, targets, verified)
            pools = _pooling_rows(batch)
            hidden_rows = (torch.tensor([r for _, rows in pools for r in rows], dtype=torch.int64)
                           if pools else None)
            if self.world_size > 1:
                logits, hidden = self._run_parallel(input_ids, positions, logit_rows, hidden_rows)
            else:
                logits, hidden = self.execute_model(input_ids, positions, logit_rows, hidden_rows)
        finally:
            reset_context()
        if hidden is not None:
            pool_hidden_states(hidden.float().cpu(), pools)
        if logits is None:  # nothing to sample (every row is a prompt chunk)
            return SamplerOutput([])
        num_sampled = len(batch.samplers)
        if targets:
            record_prompt_logprobs(logits[num_sampled:num_sampled + len(targets)], targets)
            if not batch.samplers:
                return SamplerOutput([])
        # (a copy, taken before sampling, which may change its rows in place)
        spec_logits = (_verified_logits(verified, logits[num_sampled + len(targets):], logits)
                       if verified else None)
        logits = logits[:num_sampled]
        self.beam_logprobs(batch, logits)
        sampling = self.prepare_sample(batch.sampled_seqs, eos_token_ids,
                                       masks.result() if masks is not None else None)
        if self.faults is not None:
            self.faults.check("sampler", batch.sampled_seqs)
        token_ids = sample(logits, sampling, self.generator)
        logprobs = (compute_logprobs(logits, sampling, token_ids)
                    if sampling.num_logprobs is not None else None)
        output = SamplerOutput(token_ids.tolist(), logprobs)  # (the one copy to the host)
        if spec_logits is not None:
            self.verify_drafts(batch, verified, spec_logits, output, eos_token_ids)
        return output

    def verify_drafts(self, batch: ScheduledBatch, verified: list[tuple[int, list[int]]],
                      logits: torch.Tensor, output: SamplerOutput,
                      eos_token_ids: list[int]) -> None:
        """Verify each verified row's drafts: set output.accepted (per batch.samplers entry,
        the drafts the target accepts), replace the row's token in output.token_ids by the
        one the target emits after them and, where logprobs are asked, give every emitted
        token its logprobs (output.accepted_logprobs, output.logprobs).

        logits hold each verified row's 1 + k positions in turn. Position j is processed as
        plain decoding would process that step (DraftPosition: penalties, logit controls and
        min_tokens see the first j drafts as sampled). (A row's last position was also
        sampled above, as every row's is, from the same logits; the verifier draws its own
        tokens, from the same generator.)"""
        seqs = [batch.samplers[i][0] for i, _ in verified]
        positions = [p for seq in seqs for p in draft_positions(seq)]
        vocab = self.model_config.vocab_size
        grammar_masks = [draft_token_masks(seq.grammar, seq.spec_token_ids, vocab)
                         for seq in seqs if seq.grammar is not None]
        sampling = self.prepare_sample(positions, eos_token_ids,  # type: ignore[arg-type]
                                       torch.cat(grammar_masks) if grammar_masks else None)
        x = (apply_token_controls(logits, sampling, list(range(len(positions))))
             if sampling.changes_logits else logits.float())
        output.accepted = [[] for _ in batch.samplers]
        emitted: list[int] = []      # per position: the token it emits (0 past the last)
        at = 0
        for (i, _), seq in zip(verified, seqs):
            n = len(seq.spec_token_ids) + 1
            part, at = x[at:at + n], at + n
            sp = seq.sampling_params
            if sp.temperature == 0:
                out = verify_greedy(part.argmax(-1).tolist(), seq.spec_token_ids)
            else:
                out = verify_sampled(_target_probs(part, sp, self.model_config.vocab_size),
                                     seq.spec_token_ids, seq.generator or self.generator)
            output.accepted[i], output.token_ids[i] = out[:-1], out[-1]
            emitted.extend(out + [0] * (n - len(out)))
        if sampling.num_logprobs is None:
            return
        assert output.logprobs is not None  # (a row asking logprobs was sampled too)
        logprobs = compute_logprobs(logits, sampling, torch.tensor(emitted))
        output.accepted_logprobs = [[] for _ in batch.samplers]
        at = 0
        for (i, _), seq in zip(verified, seqs):
            n = len(output.accepted[i])
            output.accepted_logprobs[i] = logprobs[at:at + n]
            output.logprobs[i] = logprobs[at + n]
            at += len(seq.spec_token_ids) + 1

    @staticmethod
    def beam_logprobs(batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Beams are not sampled: give each its next-token log-probabilities (fp32)."""
        rows = [i for i, (seq, _) in enumerate(batch.samplers) if seq.is_beam]
        if rows:
            logprobs = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
            for i, lp in zip(rows, logprobs):
                batch.samplers[i][0].beam_logprobs = lp

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      logit_rows: torch.Tensor, hidden_rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward pass of this rank under the current Context: the logits of the tokens
        logit_rows indexes (None when it is empty, and on ranks > 0, which only contribute
        their shard of the vocabulary), and the final hidden states of hidden_rows (for
        pooling; None without)."""
        if self.device.type != "cpu":
            input_ids, positions = self._to_device(input_ids, positions)
        if hidden_rows is None and self._keeps_rows(logit_rows, input_ids.numel()):
            # only the sampled tokens' hidden states (the model skips the others' last layer)
            hidden = self.model(input_ids, positions, keep_rows=logit_rows.to(input_ids.device))
            return self.model.compute_logits(hidden), None  # type: ignore[operator]
        hidden = self._forward(input_ids, positions)
        pooled = None if hidden_rows is None else hidden[hidden_rows.to(hidden.device)]
        if not logit_rows.numel():
            return None, pooled
        logits = self.model.compute_logits(hidden[logit_rows.to(hidden.device)])  # type: ignore[operator]
        return logits, pooled

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states of every token, by the executor this step takes: a
        replayed CUDA graph or the CPU decode stack where one applies, else the model."""
        ctx = get_context()
        if (self.graphs is not None and not ctx.is_prefill
                and input_ids.numel() <= self.graphs.max_batch_size):
            return self.graphs.run(input_ids, positions, ctx)
        if self.decode_stack is not None:
            hidden = self.decode_stack.run(input_ids, positions, ctx)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions)

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
        upload = functools.partial(_pinned_upload, device=self.device)
        set_context(**{k: (upload(v) if isinstance(v, torch.Tensor) else v)
                       for k, v in moved.items()})
        return upload(input_ids), upload(positions)

    # ---- tensor parallelism -------------------------------------------------------------------

    def _run_parallel(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      logit_rows: torch.Tensor, hidden_rows: torch.Tensor | None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rank 0: publish the step, run its shard with the others, get the gathered logits
        (and its hidden states, whole on every rank, for pooling)."""
        def step() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            self.channel.publish(StepInputs(input_ids, positions, get_context(), logit_rows,
                                            hidden_rows is not None))
            return self.execute_model(input_ids, positions, logit_rows, hidden_rows)
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


def _pinned_upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to the device asynchronously, from pinned memory."""
    return t.pin_memory().to(device, non_blocking=True)


def _bad_words_due(seq: Sequence) -> list[list[int]]:
    """The bad words whose last token would complete them now: all but their last token end
    the output so far (one-token words always)."""
    out = seq.completion_token_ids
    return [ids for ids in seq.bad_words_token_ids
            if len(ids) - 1 <= len(out) and (len(ids) == 1 or out[len(out) - len(ids) + 1:] == ids[:-1])]


def _prompt_logprob_targets(batch: ScheduledBatch) -> list[tuple[Sequence, int, int]]:
    """(sequence, flat token row, prompt index) for each prompt token whose logprob this step
    computes: row p's logits give the logprob of the token at p + 1, for the prompt tokens
    of a sequence asking prompt_logprobs that it has not recorded yet (a recomputed prompt,
    after a preemption, is not recorded twice). Needs the Context."""
    targets: list[tuple[Sequence, int, int]] = []
    cu = get_context().cu_seqlens_q.tolist()
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if seq.prompt_logprobs is None or len(seq.prompt_logprobs) >= seq.num_prompt_tokens:
            continue
        start = seq.num_computed_tokens
        for target in range(max(start + 1, len(seq.prompt_logprobs)),
                            min(start + n, seq.num_prompt_tokens - 1) + 1):
            targets.append((seq, cu[row] + target - 1 - start, target))
    return targets


def record_prompt_logprobs(logits: torch.Tensor, targets: list[tuple[Sequence, int, int]]) -> None:
    """Append each target's TokenLogprobs (its log-softmax, fp32) to its sequence."""
    logprobs = logits.float().log_softmax(-1)
    ids = torch.tensor([seq.token_ids[target] for seq, _, target in targets], device=logits.device)
    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1).tolist()
    k = max(seq.sampling_params.prompt_logprobs for seq, _, _ in targets)
    top_values, top_ids = logprobs.topk(k, -1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for i, (seq, _, target) in enumerate(targets):
        n = seq.sampling_params.prompt_logprobs
        assert len(seq.prompt_logprobs) == target
        seq.prompt_logprobs.append(TokenLogprobs(
            seq.token_ids[target], chosen[i], list(zip(top_ids[i][:n], top_values[i][:n]))))


def _pooling_rows(batch: ScheduledBatch) -> list[tuple[Sequence, list[int]]]:
    """(sequence, flat token rows) whose final hidden states an embedding request pools this
    step: every prompt row of the chunk (mean) or the prompt's last token (last). A
    recompute after preemption pools nothing again. Needs the Context."""
    pools: list[tuple[Sequence, list[int]]] = []
    cu = get_context().cu_seqlens_q.tolist()
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        pooling = seq.sampling_params.pooling
        if pooling is None or seq.num_pooled_tokens >= seq.num_prompt_tokens:
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens)
        first = max(start, seq.num_pooled_tokens) if pooling.pooling == "mean" else end - 1
        if pooling.pooling == "last" and end != seq.num_prompt_tokens:
            continue
        pools.append((seq, [cu[row] + p - start for p in range(first, end)]))
    return pools


def pool_hidden_states(hidden: torch.Tensor, pools: list[tuple[Sequence, list[int]]]) -> None:
    """Add each pool's rows of hidden [sum of rows, H] (fp32) to its sequence."""
    at = 0
    for seq, rows in pools:
        part = hidden[at:at + len(rows)]
        at += len(rows)
        total = part.sum(0)
        seq.pooled = total if seq.pooled is None else seq.pooled + total
        seq.num_pooled_tokens = (seq.num_prompt_tokens if seq.sampling_params.pooling.pooling == "last"
                                 else seq.num_pooled_tokens + len(rows))


def _verified_rows(batch: ScheduledBatch) -> list[tuple[int, list[int]]]:
    """(batch.samplers index, flat token rows) of each row verifying draft tokens: its last
    token and its drafts, whose logits give the target's distributions for the drafts and
    the token after them. Needs the Context."""
    cu = get_context().cu_seqlens_q.tolist()
    return [(i, list(range(cu[row + 1] - 1 - batch.num_spec_tokens[row], cu[row + 1])))
            for i, (_, row) in enumerate(batch.samplers) if batch.num_spec_tokens[row]]


def _target_probs(logits: torch.Tensor, sp: SamplingParams, vocab_size: int) -> torch.Tensor:
    """The distribution sample() draws from for a row with these params (temperature, then
    top-k / top-p / min-p), at each of logits' positions [P, V] -> fp32 [P, V]."""
    n, device = logits.shape[0], logits.device
    top_k = torch.full((n,), sp.top_k, device=device) if 0 < sp.top_k < vocab_size else None
    top_p = torch.full((n,), sp.top_p, device=device) if sp.top_p < 1 else None
    min_p = torch.full((n,), sp.min_p, device=device) if sp.min_p > 0 else None
    return apply_top_k_top_p_min_p(logits / sp.temperature, top_k, top_p, min_p).softmax(-1)


def _logit_rows(batch: ScheduledBatch, targets: list[tuple[Sequence, int, int]],
                verified: list[tuple[int, list[int]]]) -> torch.Tensor:
    """Index of the token whose logits each batch.samplers entry samples from (a row's last
    token; a row sampled by several forks appears once per fork), then the prompt-logprob
    targets' rows, then the verified rows' positions but their last (sampled already: its
    logits are the sampled row's, _verified_logits). Needs the Context."""
    last = get_context().cu_seqlens_q[1:] - 1
    rows = last[torch.tensor([row for _, row in batch.samplers], dtype=torch.int64)]
    extra = [r for _, r, _ in targets] + [r for _, positions in verified for r in positions[:-1]]
    if extra:
        rows = torch.cat([rows, torch.tensor(extra, dtype=torch.int64)])
    return rows


def _verified_logits(verified: list[tuple[int, list[int]]], spec_logits: torch.Tensor,
                     sampled_logits: torch.Tensor) -> torch.Tensor:
    """Each verified row's 1 + k positions in turn: its k draft positions' logits (computed
    for the verifier) then its last position's, the logits its batch.samplers entry has."""
    parts, at = [], 0
    for i, positions in verified:
        k = len(positions) - 1
        parts += [spec_logits[at:at + k], sampled_logits[i:i + 1]]
        at += k
    return torch.cat(parts)


def _ids(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst = zip(*pairs)
    return torch.tensor(src), torch.tensor(dst)
