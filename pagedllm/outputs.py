"""What the engine returns for each request (vLLM's RequestOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own and the k most likely, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # One entry per generated token when SamplingParams.logprobs is set, else None.
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # speculative decoding: drafts (steps that verified draft tokens), draft tokens verified
    # for the request and how many were accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (None without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verifying step appends on average: 1 + accepted / drafts (vLLM's mean
        acceptance length; None without drafts)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    extra: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob given the tokens
    # before it and the k most likely there (the first token has none: None).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With SamplingParams.pooling: the prompt's pooled final hidden state (fp32 values).
    embedding: list[float] | None = None

    @property
    def text(self) -> str:
        """Text of the first (usually only) completion."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
