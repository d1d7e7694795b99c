"""SamplingParams: how one request is decoded, validated at construction."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PoolingParams:
    """An embedding request: the prompt's final hidden states (after the final norm)
    pooled, by the last token's or the mean of all, and L2-normalised unless told not to."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of a JSON schema (a dict or its
    JSON text), any JSON object, a regular expression, a choice of strings, or a grammar
    (Lark, as llguidance reads it, or llama.cpp's GBNF). Whether it compiles is checked
    when the request is added (layers/structured_output.py), where the tokenizer is known.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), "
                             f"got {type(self.json).__name__}")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def key(self) -> str:
        """What identifies the compiled constraint (the compiler's cache key)."""
        for name in ("json", "json_object", "regex", "choice", "grammar"):
            value = getattr(self, name)
            if value not in (None, False):
                return name + ":" + json.dumps(value, sort_keys=True)
        raise AssertionError("unreachable: validated in __post_init__")


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
    # Logprobs of the prompt's tokens, with this many top alternatives each (vLLM's name);
    # such a request computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: int | None = None
    # Token controls (OpenAI's logit_bias, vLLM's allowed_token_ids and bad_words): a bias
    # added to each listed token's logit (-100..100; OpenAI's JSON keys are strings), the
    # only tokens that may be sampled, and words whose last token is banned wherever the
    # output so far ends with the rest of the word.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # An embedding request (LLM.embed, /v1/embeddings): the output is the pooled hidden state
    # (RequestOutput.embedding); one token is sampled and not returned.
    pooling: PoolingParams | None = None
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
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.pooling, dict):
            self.pooling = PoolingParams(**self.pooling)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
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
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed <= 2**64 - self.n):
            # (torch's generators take seeds in [-2**63, 2**64); sample i takes seed + i)
            fail(f"seed must be an integer in [-2**63, 2**64 - n], got {self.seed!r}")
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
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= 20):
            fail(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(_is_token_id(t) for t in self.allowed_token_ids)):
            fail(f"allowed_token_ids must be a non-empty list of token ids, got "
                 f"{self.allowed_token_ids!r}")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list)
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            fail(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            fail(f"structured_outputs must be a StructuredOutputsParams, got "
                 f"{type(self.structured_outputs).__name__}")
        if self.pooling is not None and (self.n != 1 or self.use_beam_search
                                         or self.max_tokens != 1):
            fail("an embedding request (pooling) takes n = 1, max_tokens = 1, no beam search")
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
        if self.logprobs is not None or self.prompt_logprobs is not None:
            fail("logprobs are not supported with beam search")
        if self.has_token_controls or self.structured_outputs is not None:
            fail("logit_bias, allowed_token_ids, bad_words and structured outputs are not "
                 "supported with beam search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_token_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias} from a dict whose keys are ids or their decimal strings (JSON)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {bias!r}")
    result = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_token_id(token):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for "
                             f"token {token}")
        result[token] = float(value)
    return result


def _is_token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
