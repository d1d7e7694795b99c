"""Tokenizer (built on the `tokenizers` library), chat templates and incremental detokenization.

A :class:`Tokenizer` wraps a ready `tokenizers.Tokenizer`; the loader builds it from the
vocabulary a GGUF file stores in its metadata (loader/gguf_tokenizer.py) or from an HF
model directory's ``tokenizer.json`` (loader/hf_tokenizer.py).

``transformers`` is never imported here: it is only a test dependency.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend


class Tokenizer:
    """Text <-> token ids, plus the model's chat template and stop tokens."""

    def __init__(
        self,
        backend: Backend,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`.

        Args:
            backend: the tokenizer, post-processor included (it decides whether BOS is added).
            eos_token_ids: every id that ends generation.
            bos_token_id: the BOS id, if the model has one.
            chat_template: jinja2 chat template source.
            special_tokens: strings the chat template may refer to ("bos_token", "eos_token",
                "unk_token", "pad_token").
            vocab_size: defaults to the backend's size including added tokens.
        """
        self.backend = backend
        self.eos_token_ids: list[int] = _dedupe(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(True)
        self._compiled_template: jinja2.Template | None = None

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS are added only if the model's config asks for them."""
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if isinstance(text, str):  # the tokenizer takes only encodable text
                _check_encodable(text)
            raise

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special (control) tokens are dropped unless asked for."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as HF transformers does.

        The template runs in an immutable jinja2 sandbox with ``raise_exception``,
        ``strftime_now``, a non-escaping ``tojson`` and the special token strings.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        variables: dict[str, Any] = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(template_kwargs)
        return self._compiled_template.render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **variables)

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (HF fast-tokenizer layout)."""
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        config.update({k: v for k, v in self.special_tokens.items() if v is not None})
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

class IncrementalDetokenizer:
    """UTF-8 safe incremental detokenization (vLLM's prefix_offset/read_offset method).

    Every step decodes two windows that start at ``prefix_offset``: up to ``read_offset``
    (text already emitted) and up to the newest token. Their difference is the new text,
    released only if it does not end in U+FFFD, i.e. an incomplete multi-byte character
    yields nothing until a later token completes it. Decoding a few tokens of left context
    instead of the lone new token keeps space handling (e.g. SentencePiece's leading-space
    strip) and byte-level merges consistent with a full decode.
    """

    _PROMPT_CONTEXT = 5  # tokens of prompt decoded as left context for the first output token

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(self._read_offset - self._PROMPT_CONTEXT, 0)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (possibly "")."""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._token_ids[start:end],
                                      skip_special_tokens=self._skip_special_tokens)


# ============================================================================ chat templates

class _GenerationBlock(jinja2.ext.Extension):
    """Accept HF's ``{% generation %}...{% endgeneration %}`` marker and render its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # unlike jinja's own filter, no HTML escaping: chat prompts are not HTML
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like HF transformers'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc


def _check_encodable(text: str) -> None:
    """ValueError where text holds what UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None


def _dedupe(ids: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids))
