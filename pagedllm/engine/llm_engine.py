"""LLMEngine: the synchronous core. add_request / step / abort_request."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.loader import load_model_source
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _RequestState:
    """Per-request output state kept beside the Sequence the scheduler moves around."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    text: str = ""
    last_delta: str = ""
    error: str | None = None


@dataclass
class StepStats:
    """What the last step did, for progress bars, logs and metrics."""

    is_prefill: bool = False
    num_seqs: int = 0
    num_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = load_model_source(config.model)
        self.model_config = source.config
        self.tokenizer: Tokenizer = source.tokenizer
        config.resolve(min(source.config.max_position_embeddings,
                           config.max_model_len or source.config.max_position_embeddings))
        self.eos_token_ids = list(self.tokenizer.eos_token_ids or source.config.eos_token_ids)
        self.model_runner = ModelRunner(config, source.config, source.weights(config.torch_dtype))
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.scheduler = Scheduler(
            num_blocks=self.model_runner.num_kvcache_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, eos_token_ids=self.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching)
        self.requests: dict[str, _RequestState] = {}
        self.last_step = StepStats()
        self.num_prompt_tokens = 0        # computed (not cached) prompt tokens, lifetime
        self.num_generation_tokens = 0

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
        if len(token_ids) >= cfg.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, but max_model_len is "
                             f"{cfg.max_model_len} (prompt + at least one output token)")
        total = min(cfg.max_model_len, len(token_ids) + (sp.max_tokens or cfg.max_model_len))
        blocks = -(-total // cfg.block_size)
        cache_blocks = self.scheduler.block_manager.num_blocks
        if blocks > cache_blocks:
            raise ValueError(
                f"request needs up to {total} tokens = {blocks} KV blocks, but the whole KV cache "
                f"holds {cache_blocks} blocks ({cache_blocks * cfg.block_size} tokens); lower "
                f"max_tokens or raise the KV-cache budget")

    def add_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError, naming the problem, if it can never run."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, sampling_params)
        now = time.time() if arrival_time is None else arrival_time
        seq = Sequence(token_ids, sampling_params, self.config.block_size, request_id, now)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids,
                                       skip_special_tokens=sampling_params.skip_special_tokens)
        self.requests[request_id] = _RequestState(seq, text, detok, RequestMetrics(now))
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        return self._output(state)

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the requests it advanced."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        t = time.perf_counter()
        now = time.time()
        for seq in seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if is_prefill:
                metrics.num_cached_tokens = seq.num_cached_tokens
        try:
            token_ids = self.model_runner.run(seqs, is_prefill, self.eos_token_ids)
        except Exception as e:  # one bad batch must not take the engine down
            logger.exception("step failed for requests %s", [s.request_id for s in seqs])
            return self._fail(seqs, f"{type(e).__name__}: {e}")
        num_tokens = (sum(len(s) - s.num_cached_tokens for s in seqs) if is_prefill else len(seqs))
        if is_prefill:
            self.num_prompt_tokens += num_tokens
        self.num_generation_tokens += len(seqs)
        self.scheduler.postprocess(seqs, token_ids)
        outputs = [self._process_new_token(seq) for seq in seqs]
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        self.last_step = StepStats(is_prefill, len(seqs), num_tokens, time.perf_counter() - t)
        return outputs

    def _process_new_token(self, seq: Sequence) -> RequestOutput:
        state = self.requests[seq.request_id]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.time()
        state.last_delta = state.detokenizer.add(seq.last_token)
        state.text += state.last_delta
        if not seq.is_finished:
            self._check_stop_strings(state)
        return self._output(state)

    def _check_stop_strings(self, state: _RequestState) -> None:
        sp = state.seq.sampling_params
        if not sp.stop_strs or state.seq.num_completion_tokens < sp.min_tokens:
            return
        text = state.text
        for stop in sp.stop_strs:
            # Only the tail can hold a stop string that was not there before this token.
            pos = text.find(stop, max(0, len(text) - len(state.last_delta) - len(stop) + 1))
            if pos != -1:
                state.text = text[:pos + len(stop) if sp.include_stop_str_in_output else pos]
                self.scheduler.finish(state.seq, "stop", stop)
                return

    def _fail(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        outputs = []
        for seq in seqs:
            self.scheduler.block_manager.forget_hashes(seq)
            self.scheduler.finish(seq, "error")
            state = self.requests[seq.request_id]
            state.error = error
            outputs.append(self._output(state))
        return outputs

    def _output(self, state: _RequestState) -> RequestOutput:
        seq = state.seq
        finished = seq.status == SequenceStatus.FINISHED
        if finished:
            state.metrics.finished_time = time.time()
            state.metrics.num_preemptions = seq.num_preemptions
            self.requests.pop(seq.request_id, None)
        completion = CompletionOutput(0, state.text, seq.completion_token_ids,
                                      seq.finish_reason, seq.stop_reason)
        return RequestOutput(seq.request_id, state.prompt, seq.prompt_token_ids, [completion],
                             finished, state.metrics, state.error)

    # ---- introspection ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
