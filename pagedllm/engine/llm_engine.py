"""LLMEngine: the synchronous core. add_request / step / abort_request."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from pagedllm.config import DRAFT_METHODS, EngineConfig
from pagedllm.distributed import torchrun_env
from pagedllm.kernels.probes import gguf_linear_available
from pagedllm.engine.beam_search import BeamSearchState
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.fault_injection import FaultInjector
from pagedllm.engine.kv_cache import KVCacheShape, available_memory_bytes, gpu_available_bytes
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.spec_decode.control import SpeculationControl
from pagedllm.engine.spec_decode.draft_model import build_draft_proposer
from pagedllm.engine.spec_decode.ngram import NgramProposer
from pagedllm.engine.spec_decode.proposer import Proposer
from pagedllm.engine.spec_decode.suffix import SuffixProposer
from pagedllm.engine.stats import EngineStats, KVCacheSnapshot, KVMemoryStats, StepStats
from pagedllm.engine.tp.errors import TensorParallelError
from pagedllm.engine.tp.processes import WorkerProcesses, rank0_dist_info
from pagedllm.engine.tp.worker import serve_worker_rank, worker_main
from pagedllm.layers.gguf_packing import SUPPORTED_TYPES
from pagedllm.layers.structured_output import GrammarCompiler
from pagedllm.loader import ModelSource, load_model_source
from pagedllm.loader.model_loader import resident_line
from pagedllm.loader.validate import check_fits_in_memory
from pagedllm.models.config import ModelConfig
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _SampleState:
    """Output state of one of a request's n samples, beside the Sequence the scheduler moves."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""
    last_delta: str = ""
    logprobs: list[TokenLogprobs] | None = None   # one per token when the request asks


@dataclass
class _RequestState:
    """Per-request output state: its samples (n of them; n = 1 usually), prompt, metrics."""

    samples: list[_SampleState]
    prompt: str | None
    metrics: RequestMetrics
    error: str | None = None
    beam: BeamSearchState | None = None   # beam search requests only

    @property
    def seq(self) -> Sequence:
        """The first sample's sequence (the one that prefills the prompt)."""
        return self.samples[0].seq

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.seq.is_finished for s in self.samples)


def _default_quantization(config: EngineConfig, source: ModelSource) -> str:
    """gguf for a GGUF file with types the CPU kernel takes, where the options leave it
    free (CPU, one rank, dtype auto), else none."""
    cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    free = config.dtype == "auto" and config.tensor_parallel_size == 1
    if (source.format == "gguf" and cpu and free and set(SUPPORTED_TYPES) & source.tensor_types
            and gguf_linear_available()):
        return "gguf"
    return "none"


def _type_names(types: frozenset) -> str:
    return ", ".join(sorted(t.name for t in types))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = load_model_source(config.model)
        if config.quantization is None:
            config.quantization = _default_quantization(config, source)
        self.model_config = source.config
        self.tokenizer: Tokenizer = source.tokenizer
        config.resolve(min(source.config.max_position_embeddings,
                           config.max_model_len or source.config.max_position_embeddings))
        self.eos_token_ids = list(self.tokenizer.eos_token_ids or source.config.eos_token_ids)
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(source.config, config.tensor_parallel_size)
            env = torchrun_env()
            if env is not None and env.world_size > 1 and env.rank != 0:
                serve_worker_rank(config, env)  # never returns: this rank only runs shards
        keep = frozenset()
        if config.quantization == "gguf":
            if source.format != "gguf":
                raise ValueError(f"quantization=gguf needs a GGUF model; {source.path!r} is "
                                 f"{source.format}")
            if not gguf_linear_available():
                raise ValueError("quantization=gguf needs the CPU kernels built with AVX2 "
                                 "(+FMA, F16C) or AVX-512 (this CPU or build has neither)")
            keep = frozenset(SUPPORTED_TYPES) & source.tensor_types
            if not keep:
                raise ValueError(
                    f"quantization=gguf: {source.path!r} has no weights of the types kept "
                    f"quantized ({_type_names(SUPPORTED_TYPES)}); its types: "
                    f"{_type_names(source.tensor_types)}")
            logger.info("quantization gguf: %s weights kept quantized, %s dequantized to %s",
                        _type_names(keep) or "no", _type_names(source.tensor_types - keep)
                        or "no", config.dtype)
        available = (gpu_available_bytes(torch.device("cuda", torch.cuda.current_device()),
                                         config.gpu_memory_utilization)
                     if config.device == "cuda" else available_memory_bytes())
        check_fits_in_memory(source.config, config.torch_dtype, available,
                             source.path, KVCacheShape.of(config, source.config).block_bytes,
                             source.kept_size(keep))
        dist_info = workers = None
        if config.tensor_parallel_size > 1:  # rank 0: the other ranks join it, or it starts them
            dist_info, spawn = rank0_dist_info(config.tensor_parallel_size)
            workers = WorkerProcesses(config, dist_info, spawn, target=worker_main)
        self.model_runner = ModelRunner(config, source.config,
                                        source.weights(config.torch_dtype, keep), dist_info,
                                        workers)
        logger.info(resident_line(self.model_runner.model, source.config, config.torch_dtype,
                                  source.path, source.format, config.tensor_parallel_size))
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        spec = config.speculative_config
        proposer = (build_draft_proposer(config, self.model_runner, source)
                    if spec is not None and spec["method"] in DRAFT_METHODS
                    else _proposer(spec))
        self.scheduler = Scheduler(
            num_blocks=self.model_runner.num_kvcache_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, eos_token_ids=self.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=self.model_runner.num_swap_blocks,
            sliding_window=(source.config.sliding_window if source.config.all_layers_sliding
                            else None),
            proposer=proposer, spec_control=_spec_control(spec))
        self.grammars = GrammarCompiler(self.tokenizer, source.config.vocab_size,
                                        self.eos_token_ids[0] if self.eos_token_ids else None)
        self.requests: dict[str, _RequestState] = {}
        self.last_step = StepStats()
        self.num_prompt_tokens = 0        # computed (not cached) prompt tokens, lifetime
        self.num_generation_tokens = 0
        self.kv_stats = KVMemoryStats()
        self.dead_error: str | None = None   # set once the engine has stopped for good
        self.faults: FaultInjector | None = None
        self.set_fault_injector(FaultInjector.from_env())

    def set_fault_injector(self, faults: FaultInjector | None) -> None:
        """Test-only: make chosen stages raise (see engine/fault_injection.py); None turns it off."""
        if self.faults is not None:
            self.faults.uninstall()
        self.faults = faults
        self.model_runner.faults = faults
        if faults is not None:
            faults.decode = self.tokenizer.decode
            faults.install(self.model_runner.model)

    # ---- requests ----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids")
        return None, list(prompt)

    def validate_prompt(self, token_ids: list[int], sp: SamplingParams) -> None:
        cfg = self.config
        assert cfg.max_model_len is not None
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if sp.bad_words:
            try:
                self.bad_words_token_ids(sp.bad_words)
            except ValueError as e:
                raise ValueError(f"bad_words: {e}") from None
        for name, ids in (("logit_bias", sp.logit_bias), ("allowed_token_ids", sp.allowed_token_ids),
                          ("stop_token_ids", sp.stop_token_ids)):
            bad = [t for t in ids or () if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if sp.n > cfg.max_num_seqs:
            raise ValueError(f"n={sp.n} samples exceed max_num_seqs ({cfg.max_num_seqs})")
        if len(token_ids) >= cfg.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, but max_model_len is "
                             f"{cfg.max_model_len} (prompt + at least one output token)")
        total = min(cfg.max_model_len, len(token_ids) + (sp.max_tokens or cfg.max_model_len))
        blocks = cdiv(total, cfg.block_size)
        cache_blocks = self.scheduler.block_manager.num_blocks
        if blocks > cache_blocks:
            raise ValueError(
                f"request needs up to {total} tokens = {blocks} KV blocks, but the whole KV cache "
                f"holds {cache_blocks} blocks ({cache_blocks * cfg.block_size} tokens); lower "
                f"max_tokens or raise the KV-cache budget")

    def add_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError, naming the problem, if it can never run."""
        self._check_alive()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, sampling_params)
        now = time.time() if arrival_time is None else arrival_time
        per_sample = ([sampling_params] if sampling_params.use_beam_search
                      else _per_sample_params(sampling_params))
        seqs = [Sequence(token_ids, sp, self.config.block_size, request_id, now,
                         self.config.device)
                for sp in per_sample]
        bad_words = self.bad_words_token_ids(sampling_params.bad_words or [])
        for i, seq in enumerate(seqs):
            seq.sample_index = i
            seq.bad_words_token_ids = bad_words
            if sampling_params.structured_outputs is not None:
                seq.grammar = self.grammars.matcher(sampling_params.structured_outputs)
        seqs[0].pending_forks = seqs[1:]  # forked once the prompt is computed
        samples = [_SampleState(seq, IncrementalDetokenizer(
            self.tokenizer, token_ids, skip_special_tokens=sampling_params.skip_special_tokens),
            logprobs=[] if sampling_params.logprobs is not None else None)
            for seq in seqs]
        state = _RequestState(samples, text, RequestMetrics(now))
        if sampling_params.use_beam_search:
            state.beam = self._beam_state(len(token_ids), sampling_params)
            state.beam.beams = [seqs[0]]
        self.requests[request_id] = state
        self.scheduler.add(seqs[0])

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it starts the output and, where its tokens differ but
        are as many, after a space (vLLM's rule)."""
        result = []
        for word in words:
            ids = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            result.append(ids)
            if spaced and spaced[0] != ids[0] and len(spaced) == len(ids):
                result.append(spaced)
        return result

    def _beam_state(self, prompt_len: int, sp: SamplingParams) -> BeamSearchState:
        assert self.config.max_model_len is not None
        max_tokens = self.config.max_model_len - prompt_len
        if sp.max_tokens is not None:
            max_tokens = min(max_tokens, sp.max_tokens)
        return BeamSearchState(sp.n, max_tokens, sp.length_penalty, sp.early_stopping,
                               self.eos_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self._finish_all(state, "abort")
        return self._output(state)

    def _finish_all(self, state: _RequestState, reason: str) -> None:
        for sample in state.samples:
            self.scheduler.finish(sample.seq, reason)
        if state.beam is not None:
            for beam in state.beam.beams:
                self.scheduler.finish(beam, reason)
            state.beam.beams = []
            state.beam.done = True
            state.beam.finish_reason = reason

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False (nothing forgotten) while requests run."""
        return not self.has_unfinished_requests() and self.scheduler.block_manager.reset_prefix_cache()

    # ---- the step ---------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the requests it advanced (with
        final_only, of those it finished: LLM.generate's case, which need not copy every
        running request's tokens and text into an output on every step).

        An exception inside the batch (model, sampler, one request's detokenizer) ends only
        the requests it touched, with finish reason "error". An exception in the scheduler or
        a violated invariant means the engine's own state is wrong: it stops, failing every
        request, and raises EngineDeadError rather than compute on corrupt block tables.
        """
        self._check_alive()
        try:
            if self.faults is not None:
                self.faults.check("core")
            batch = self.scheduler.schedule()
        except Exception as e:
            raise self._die(f"scheduling failed: {type(e).__name__}: {e}") from e
        if batch.has_block_moves:
            try:
                self.model_runner.move_blocks(batch)
            except Exception as e:  # the block tables already say the moves happened
                if isinstance(e, TensorParallelError):
                    self.shutdown()
                raise self._die(f"KV block moves failed: {type(e).__name__}: {e}") from e
        if not batch.seqs:
            return []
        self._check_invariants("after scheduling")
        t = time.perf_counter()
        now = time.time()
        for seq in batch.seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = seq.num_cached_tokens
        try:
            if self.faults is not None:
                self.faults.batch = batch.seqs
            sampled = self.model_runner.run(batch, self.eos_token_ids)
        except TensorParallelError as e:  # a rank is gone: nothing can run any more
            self.shutdown()
            raise self._die(str(e)) from e
        except Exception as e:  # one bad batch must not take the engine down
            logger.exception("step failed for requests %s", [s.request_id for s in batch.seqs])
            outputs = self._fail(batch.seqs + batch.sampled_seqs, f"{type(e).__name__}: {e}")
            self._check_invariants("after failing a batch")
            return outputs
        self.num_prompt_tokens += batch.num_prefill_tokens
        if sampled.logprobs is not None:
            self._record_logprobs(batch.sampled_seqs, sampled.logprobs, sampled.accepted_logprobs)
        lengths = [len(seq) for seq in batch.sampled_seqs]
        try:
            self.scheduler.postprocess(batch, sampled.token_ids, sampled.accepted)
        except Exception as e:
            raise self._die(f"postprocessing failed: {type(e).__name__}: {e}") from e
        advanced: dict[str, _RequestState] = {}
        for seq, length in zip(batch.sampled_seqs, lengths):
            if seq.request_id not in self.requests:  # its detokenizer failed just now
                continue
            if seq.is_beam:
                state = self.requests[seq.request_id]
                if state.beam is not None and state.beam.ready() and not state.beam.done:
                    self._advance_beams(state)
                    if state.beam.done:
                        advanced[seq.request_id] = state
            else:
                advanced[seq.request_id] = self._process_new_tokens(seq, length)
                self.num_generation_tokens += len(seq) - length
        outputs = [self._output(state) for state in advanced.values()
                   if not final_only or state.finished]
        self.kv_stats.step(self.scheduler, sample=self.config.check_invariants)
        self._check_invariants("after the step")
        self.last_step = StepStats(batch.num_prefill_tokens > 0, len(batch), batch.num_tokens,
                                   time.perf_counter() - t, batch.num_prefill_tokens)
        return outputs

    def _record_logprobs(self, seqs: list[Sequence], logprobs: list[TokenLogprobs | None],
                         accepted: list[list[TokenLogprobs | None]] | None) -> None:
        """Each sampled token's logprobs, accepted drafts' first; a stop that drops tokens
        drops theirs (_process_new_tokens)."""
        for i, (seq, token_logprobs) in enumerate(zip(seqs, logprobs)):
            if seq.is_beam:  # (SamplingParams rejects logprobs with beam search)
                continue
            sample = self.requests[seq.request_id].samples[seq.sample_index]
            if token_logprobs is not None and sample.logprobs is not None:
                if accepted is not None:
                    sample.logprobs.extend(accepted[i])  # type: ignore[arg-type]
                sample.logprobs.append(token_logprobs)

    def _process_new_tokens(self, seq: Sequence, first: int) -> _RequestState:
        """Detokenize the tokens this step appended (from index first on; several when
        drafts were accepted), one at a time, as if each had been sampled alone: a stop
        string completed by one of them ends the sequence there and drops the rest."""
        state = self.requests[seq.request_id]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.time()
        sample = state.samples[seq.sample_index]
        for i in range(first, len(seq)):
            try:
                if self.faults is not None:
                    self.faults.check("detokenizer", [seq])
                sample.last_delta = sample.detokenizer.add(seq.token_ids[i])
            except Exception as e:  # this request alone ends; the rest of the batch goes on
                logger.exception("detokenizing failed for request %s", seq.request_id)
                self._fail([seq], f"detokenizer: {type(e).__name__}: {e}")
                return state
            sample.text += sample.last_delta
            last = i == len(seq) - 1
            if seq.grammar is not None and not (last and seq.is_finished):
                if not self._advance_grammar(seq, seq.token_ids[i]):
                    return state
                if seq.is_finished:  # the grammar is complete: what follows is dropped
                    del seq.token_ids[i + 1:]
                    break
            if (not last or not seq.is_finished) and self._check_stop_strings(sample):
                del seq.token_ids[i + 1:]
                break
        if sample.logprobs is not None:  # tokens a stop dropped take their logprobs along
            del sample.logprobs[seq.num_completion_tokens:]
        return state

    def _advance_grammar(self, seq: Sequence, token_id: int) -> bool:
        """The grammar takes a sampled or accepted token (its mask allowed it); a completed
        grammar ends the sequence as a stop would. False: it failed the request."""
        grammar = seq.grammar
        if not grammar.consume_token(token_id):
            self._fail([seq], f"structured output: {grammar.get_error()}")
            return False
        if grammar.is_stopped():
            self.scheduler.finish(seq, "stop")
        return True

    def _advance_beams(self, state: _RequestState) -> None:
        """One beam-search step: fork the beams that continue, drop the others (their blocks
        are freed), append each new beam's token."""
        beam = state.beam
        assert beam is not None
        parents = beam.beams
        candidates = beam.select()
        used: set[int] = set()
        next_beams: list[Sequence] = []
        for cand in candidates:  # forks first, from the parents' state before this step
            parent = parents[cand.parent]
            if cand.parent in used:
                child = parent.fork()
                self.scheduler.add_fork(parent, child)
            else:
                used.add(cand.parent)
                child = parent
            next_beams.append(child)
        for i, parent in enumerate(parents):
            parent.beam_logprobs = None
            if i not in used:
                self.scheduler.finish(parent, "abort")  # a dropped beam frees its blocks
        for i, (child, cand) in enumerate(zip(next_beams, candidates)):
            child.append_token(cand.token_id)
            child.cum_logprob = cand.cum_logprob
            child.sample_index = i
        beam.beams = next_beams

    def _check_stop_strings(self, state: _SampleState) -> bool:
        """Whether the newest token's text completes a stop string: then the text ends
        there and the sequence stops (a sequence the scheduler ended at a later token of
        this step takes this stop instead)."""
        seq, sp = state.seq, state.seq.sampling_params
        if not sp.stop_strs or seq.num_completion_tokens < sp.min_tokens:
            return False
        text = state.text
        for stop in sp.stop_strs:
            # Only the tail can hold a stop string that was not there before this token.
            pos = text.find(stop, max(0, len(text) - len(state.last_delta) - len(stop) + 1))
            if pos != -1:
                state.text = text[:pos + len(stop) if sp.include_stop_str_in_output else pos]
                if seq.is_finished:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)
                return True
        return False

    def _fail(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        """End these sequences' requests with finish reason "error" and free their blocks."""
        outputs: dict[str, RequestOutput] = {}
        failed = set(id(seq) for seq in seqs)
        for seq in seqs:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            for sample in state.samples:
                if sample.seq.is_finished:
                    if id(sample.seq) in failed:  # stopped in this very step: blocks freed
                        sample.seq.finish_reason, sample.seq.stop_reason = "error", None
                    continue
                # Their newest KV may be unwritten: no later request may find it by hash.
                self.scheduler.block_manager.forget_hashes(sample.seq)
            for beam in state.beam.beams if state.beam is not None else []:
                self.scheduler.block_manager.forget_hashes(beam)
            self._finish_all(state, "error")
            state.error = error
            outputs[seq.request_id] = self._output(state)
        return list(outputs.values())

    # ---- stopping for good ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine stopped earlier: {self.dead_error}")

    def _check_invariants(self, when: str) -> None:
        """With check_invariants on, verify the block accounting; stop the engine if broken."""
        if not self.config.check_invariants:
            return
        try:
            self.scheduler.check_invariants()
            self._check_request_states()
        except AssertionError as e:
            raise self._die(f"invariant violated {when}: {e}") from e

    def _check_request_states(self) -> None:
        """Every live sequence has its request state and every request state a live sequence."""
        sched = self.scheduler
        live = {seq.request_id for seq in (*sched.waiting, *sched.running, *sched.swapped)}
        for request_id, state in self.requests.items():
            if state.finished or request_id not in live:
                raise AssertionError(f"request {request_id!r} is kept but not scheduled ({state.seq})")
        if missing := live - self.requests.keys():
            raise AssertionError(f"scheduled sequences without a request: {sorted(missing)}")

    def _die(self, message: str) -> EngineDeadError:
        """Stop for good: fail every request without touching the untrusted block accounting."""
        logger.critical("engine stopped: %s", message)
        self.dead_error = message
        outputs = []
        for state in list(self.requests.values()):
            for sample in state.samples:
                sample.seq.status = SequenceStatus.FINISHED
                sample.seq.finish_reason = "error"
            if state.beam is not None:
                state.beam.done, state.beam.finish_reason = True, "error"
            state.error = f"engine stopped: {message}"
            outputs.append(self._output(state))
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.scheduler.swapped.clear()
        return EngineDeadError(f"engine stopped: {message}", outputs)

    def _output(self, state: _RequestState) -> RequestOutput:
        seq = state.seq
        finished = state.finished
        if finished:
            state.metrics.finished_time = time.time()
            state.metrics.num_preemptions = sum(s.seq.num_preemptions for s in state.samples)
            self.requests.pop(seq.request_id, None)
        state.metrics.num_drafts = sum(s.seq.num_drafts for s in state.samples)
        state.metrics.num_draft_tokens = sum(s.seq.num_draft_tokens for s in state.samples)
        state.metrics.num_accepted_tokens = sum(s.seq.num_accepted_tokens for s in state.samples)
        if state.beam is not None:
            return self._beam_output(state)
        completions = [CompletionOutput(i, s.text, s.seq.completion_token_ids,
                                        s.seq.finish_reason, s.seq.stop_reason,
                                        list(s.logprobs) if s.logprobs is not None else None)
                       for i, s in enumerate(state.samples)]
        return RequestOutput(seq.request_id, state.prompt, seq.prompt_token_ids, completions,
                             finished, state.metrics, state.error,
                             prompt_logprobs=list(seq.prompt_logprobs)
                             if seq.prompt_logprobs is not None else None,
                             embedding=_embedding(seq) if finished else None)

    def _beam_output(self, state: _RequestState) -> RequestOutput:
        """The finished hypotheses, best first (or the live beams while it runs)."""
        beam, seq = state.beam, state.seq
        assert beam is not None
        if beam.done:
            hyps = [(h.token_ids, h.score) for h in beam.finished]
        else:
            hyps = [(b.completion_token_ids, b.cum_logprob) for b in beam.beams]
        completions = []
        for i, (tokens, _) in enumerate(hyps):
            reason = beam.finish_reason or (
                "stop" if tokens and tokens[-1] in self.eos_token_ids else "length")
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            completions.append(CompletionOutput(i, text, tokens, reason if beam.done else None))
        if not completions and beam.done:  # aborted or failed before any hypothesis
            completions.append(CompletionOutput(0, "", [], beam.finish_reason))
        out = RequestOutput(seq.request_id, state.prompt, seq.prompt_token_ids, completions,
                            beam.done, state.metrics, state.error)
        out.extra["beam_scores"] = [score for _, score in hyps]
        return out

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank); idempotent."""
        self.model_runner.shutdown()

    # ---- introspection ------------------------------------------------------------------------

    def kv_memory_report(self) -> str:
        """Tokens held vs KV slots allocated over the steps so far (internal fragmentation of
        partly filled last blocks), and the prefix-cache hit rate."""
        return self.kv_stats.report(self.scheduler)

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks=bm.num_blocks, num_used_blocks=bm.num_blocks - bm.num_free_blocks,
            num_free_blocks=bm.num_free_blocks, num_cached_free_blocks=bm.num_cached_free_blocks,
            prefix_cache_hit_rate=bm.hit_rate, num_preemptions=self.scheduler.num_preemptions,
            num_drafts=self.scheduler.num_drafts,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_tokens=self.scheduler.num_accepted_tokens)

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """State of every physical block and every request's block table, for the web UI."""
        bm = self.scheduler.block_manager
        cached = [b.hash != -1 and bm.hash_to_block_id.get(b.hash) == b.block_id
                  for b in bm.blocks]
        requests = [{"request_id": seq.request_id, "status": seq.status.name.lower(),
                     "num_prompt_tokens": seq.num_prompt_tokens, "num_tokens": len(seq),
                     "num_cached_tokens": seq.num_cached_tokens,
                     "block_table": list(seq.block_table)}
                    for seq in (*self.scheduler.running, *self.scheduler.swapped,
                                *self.scheduler.waiting)]
        return KVCacheSnapshot(bm.block_size, [b.ref_count for b in bm.blocks], cached,
                               requests, self.stats())

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def _embedding(seq: Sequence) -> list[float] | None:
    """An embedding request's pooled hidden state, normalised where asked."""
    pooling = seq.sampling_params.pooling
    if pooling is None or seq.pooled is None:
        return None
    vector = seq.pooled / seq.num_pooled_tokens if pooling.pooling == "mean" else seq.pooled
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


def _proposer(speculative_config: dict | None) -> Proposer | None:
    if speculative_config is None:
        return None
    c = speculative_config
    if c["method"] == "suffix":
        return SuffixProposer(c["num_speculative_tokens"], c["suffix_decoding_max_tree_depth"],
                              c["suffix_decoding_max_cached_requests"],
                              c["suffix_decoding_max_spec_factor"],
                              c["suffix_decoding_min_token_prob"])
    return NgramProposer(c["num_speculative_tokens"], c["prompt_lookup_min"],
                         c["prompt_lookup_max"])


def _spec_control(speculative_config: dict | None) -> SpeculationControl | None:
    if speculative_config is None:
        return None
    return SpeculationControl(speculative_config["adaptive"],
                              speculative_config["disable_by_batch_size"])


def _per_sample_params(sp: SamplingParams) -> list[SamplingParams]:
    """The n samples' params: sample i of a seeded request draws from seed + i, so it equals
    the n = 1 request with that seed, whatever the batch."""
    if sp.n == 1:
        return [sp]
    return [replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]


def check_tensor_parallel(mc: ModelConfig, tp: int) -> None:
    """Reject a tensor_parallel_size the model's shapes cannot be split by."""
    problems = []
    if mc.num_attention_heads % tp:
        problems.append(f"num_attention_heads={mc.num_attention_heads} is not divisible by it")
    kv = mc.num_key_value_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides it nor is divisible by it")
    if mc.intermediate_size % tp:
        problems.append(f"intermediate_size={mc.intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not fit {mc.name or mc.architecture}: "
                         + "; ".join(problems))
