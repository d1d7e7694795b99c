"""SamplingParams: how one request is decoded, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding options, with vLLM's names and defaults.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. A seed makes this request's sampling reproducible
    whatever else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # Beam search (as vLLM's LLM.beam_search / HF generate(num_beams=n)): n beams, scored
    # by log-prob sum / generated_length ** length_penalty; early_stopping True, False or
    # "never" as in transformers.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_strs: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            fail(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for s in self.stop_strs:
            if not isinstance(s, str) or not s:
                fail(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                fail(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                fail(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.use_beam_search:
            self._validate_beam_search(fail)

    def _validate_beam_search(self, fail) -> None:  # type: ignore[no-untyped-def]
        if not _is_number(self.length_penalty):
            fail(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            fail(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.temperature != 0:
            fail(f"temperature must be 0 with beam search (it is deterministic), "
                 f"got {self.temperature!r}")
        if self.stop_strs:
            fail("stop strings are not supported with beam search")
        if self.min_tokens:
            fail("min_tokens is not supported with beam search")
        if self.ignore_eos or self.stop_token_ids:
            fail("ignore_eos and stop_token_ids are not supported with beam search (it stops "
                 "at the model's EOS tokens)")
        if self.has_penalties:
            fail("penalties (repetition, presence, frequency) are not supported with beam search")
        if self.logprobs is not None:
            fail("logprobs are not supported with beam search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
