"""Structured outputs: each constrained sequence carries a grammar matcher (llguidance),
which gives the step its token mask and takes each sampled token.

Why llguidance: it computes a mask for the whole vocabulary on the CPU in tens of
microseconds (SmolLM2's 49152 tokens under a JSON schema: ~22 us), builds the lexer lazily
so a new schema is ready in about a millisecond (no compile stall), and is one wheel with no
dependencies; it reads JSON schemas, regular expressions, Lark grammars and, converted,
llama.cpp's GBNF. (xgrammar, the other maintained choice, compiles each grammar up front.)

The compiler is shared by the engine thread and the server's worker threads: compiled
grammars are cached by their constraint, and each sequence gets its own copy of the
matcher. Masks of several rows are computed on llguidance's own threads, without the GIL.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.tokenizer import Tokenizer

# JSON as models write it: ", " and ": " between items, no other whitespace (a small
# model free to add whitespace may add it until max_tokens).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a dependency of pagedllm: only a broken install lacks it
        raise ValueError("structured outputs need the llguidance package "
                         "(pip install llguidance)") from e
    return llguidance


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer and vocabulary size."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id  # the token a finished grammar allows
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None            # built at the first constraint (~0.2 s)
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # key -> matcher, LRU

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _llguidance().LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for the constraint; ValueError naming what does not compile."""
        key = params.key
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template.deep_copy()
        template = self._compile(params)
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        ll = _llguidance()
        what, grammar = _grammar(ll, params)
        matcher = ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{what} does not compile: {matcher.get_error()}")
        return matcher


_executor: Any = None  # llguidance's thread pool, made at the first step with several rows


def fill_token_masks(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """The matchers' next-token masks, int32 [len(matchers), ceil(vocab_size / 32)]."""
    global _executor
    words = (vocab_size + 31) // 32
    masks = torch.empty(len(matchers), words, dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(masks.data_ptr(), words * 4)
        return masks
    if _executor is None:
        _executor = _llguidance().LLExecutor(num_threads=torch.get_num_threads())
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                      masks.data_ptr(), words * 4, len(matchers))
    return masks


def draft_token_masks(matcher: Any, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """The masks of a row verifying drafts under a grammar, int32 [len(drafts) + 1, W]: row j
    is the mask after the first j drafts. The drafts are consumed to compute them and rolled
    back after (the engine consumes what is accepted). Past the first draft the grammar
    refuses, that draft is masked and so rejected: later rows are never read and allow
    everything."""
    words = (vocab_size + 31) // 32
    masks = torch.full((len(drafts) + 1, words), -1, dtype=torch.int32)
    valid = matcher.validate_tokens(drafts)
    for j in range(valid + 1):
        if j and not matcher.consume_token(drafts[j - 1]):  # (validate_tokens said it would)
            raise RuntimeError(f"structured output: {matcher.get_error()}")
        matcher.unsafe_compute_mask_ptr(masks[j].data_ptr(), words * 4)
    matcher.rollback(valid)
    return masks


def _grammar(ll: Any, params: StructuredOutputsParams) -> tuple[str, str]:
    """(the field that holds the constraint, llguidance's grammar text for it)."""
    if params.json is not None:
        schema = {} if params.json is True else params.json
        return "json", ll.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if params.json_object:
        return "json_object", ll.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS)
    if params.regex is not None:
        return "regex", ll.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
        return "choice", ll.LLMatcher.grammar_from_lark(lark)
    assert params.grammar is not None
    text = params.grammar
    if "::=" in text:  # llama.cpp's GBNF
        try:
            text = ll.gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter's message names the problem
            raise ValueError(f"structured_outputs.grammar is not valid GBNF: {e}") from None
    return "grammar", ll.LLMatcher.grammar_from_lark(text)
