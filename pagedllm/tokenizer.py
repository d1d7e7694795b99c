"""Tokenizer (built on the `tokenizers` library), chat templates and incremental detokenization.

A :class:`Tokenizer` is made either from an HF model directory (``tokenizer.json``) or from
the vocabulary a GGUF file stores in its metadata. For GGUF we rebuild what llama.cpp
does: a byte-level BPE ("gpt2" model) whose pre-tokenizer splits text with the regexes
llama.cpp uses for the file's ``tokenizer.ggml.pre`` value, or a SentencePiece-style BPE
with byte fallback ("llama" model). Control and user-defined tokens become added tokens,
so ``<|im_start|>`` in chat-templated text encodes to its single id.

``transformers`` is never imported here: it is only a test dependency.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from pagedllm.loader.errors import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Pre-tokenizer regexes, as llama.cpp applies them for each `tokenizer.ggml.pre` value
# (src/llama-vocab.cpp). A list is applied in sequence, each regex splitting the pieces the
# previous one produced.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    **{name: [_GPT2_SPLIT] for name in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    # StarCoder-family vocabularies (SmolLM's among them) split every digit on its own first
    **{name: [r"\p{N}", _GPT2_SPLIT] for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: [_LLAMA3_SPLIT] for name in (
        "llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "smaug-bpe", "dbrx")},
    **{name: [_QWEN2_SPLIT] for name in (
        "qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez")},
    **{name: [_GPT4O_SPLIT] for name in ("gpt-4o", "llama4", "minimax-m2")},
}
# Vocabularies whose reference tokenizer takes a pre-token whole when it is in the vocabulary
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "gpt-4o", "llama4"})

SPIECE_UNDERLINE = "\u2581"


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
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, source: "GGUFReader | Mapping[str, Any]") -> "Tokenizer":
        """Build the tokenizer a GGUF file describes.

        Args:
            source: a ``gguf.GGUFReader`` or its metadata already decoded to Python values
                (see ``pagedllm.loader.gguf_loader.read_metadata``).
        """
        metadata = source if isinstance(source, Mapping) else _decode_reader_metadata(source)
        tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
        model_type = metadata.get("tokenizer.ggml.model")
        backend, add_bos_default = _build_gguf_backend(model_type, tokens, token_types, metadata)
        _add_gguf_special_tokens(backend, tokens, token_types)

        def token_id(key: str) -> int | None:
            index = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return index if index is not None and 0 <= index < len(tokens) else None

        bos_id = token_id("bos")
        eos_ids = [i for i in (token_id("eos"), token_id("eot"), token_id("eom")) if i is not None]
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        _set_special_post_processor(backend, tokens, bos_id if add_bos else None,
                                    eos_ids[0] if add_eos and eos_ids else None)
        special = {f"{name}_token": tokens[i] if (i := token_id(key)) is not None else None
                   for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
        return cls(backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                   chat_template=metadata.get("tokenizer.chat_template"),
                   special_tokens=special, vocab_size=len(tokens))

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, chat template, eos ids) from an HF dir."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ModelLoadError(
                f"{path!r} has no tokenizer.json; only fast (tokenizers) tokenizers are supported")
        try:
            backend = Backend.from_file(tokenizer_file)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"cannot read tokenizer {tokenizer_file!r}: {exc}") from exc
        tok_config = _read_json(os.path.join(path, "tokenizer_config.json"))
        model_config = _read_json(os.path.join(path, "config.json"))
        generation_config = _read_json(os.path.join(path, "generation_config.json"))

        special = {name: _token_content(tok_config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos_ids = (_as_id_list(model_config.get("eos_token_id"))
                   + _as_id_list(generation_config.get("eos_token_id")))
        if special["eos_token"] is not None and (eos := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids.append(eos)
        bos_id = model_config.get("bos_token_id")
        if bos_id is None and special["bos_token"] is not None:
            bos_id = backend.token_to_id(special["bos_token"])
        return cls(backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                   chat_template=_hf_chat_template(path, tok_config), special_tokens=special)


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


# ============================================================================ GGUF vocabularies

def _decode_reader_metadata(reader: "GGUFReader") -> dict[str, Any]:
    from pagedllm.loader.gguf_loader import read_metadata  # lazy: the loader imports this module
    return read_metadata(reader)


def _build_gguf_backend(model_type: str | None, tokens: list[str], token_types: list[int],
                        metadata: Mapping[str, Any]) -> tuple[Backend, bool]:
    """The tokenizer for a GGUF ``tokenizer.ggml.model``, and whether it adds BOS by default."""
    if model_type == "gpt2":
        return _byte_level_bpe(tokens, metadata), False
    if model_type == "llama":
        return _sentencepiece_bpe(tokens, token_types, metadata), True
    raise ModelLoadError(
        f"GGUF tokenizer model {model_type!r} is not supported (supported: 'gpt2' byte-level BPE, "
        f"'llama' SentencePiece BPE)")


def _byte_level_bpe(tokens: list[str], metadata: Mapping[str, Any]) -> Backend:
    """GPT-2 style byte-level BPE with the pre-tokenizer llama.cpp uses for this vocabulary."""
    merges_text = metadata.get("tokenizer.ggml.merges")
    if merges_text is None:
        raise ModelLoadError("GGUF 'gpt2' tokenizer has no merges (tokenizer.ggml.merges)")
    merges = [_split_merge(m) for m in merges_text]
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    splits = _PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        logger.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 default split", pre)
        splits = _PRE_TOKENIZER_SPLITS["default"]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(_bpe_model(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _bpe_model(**kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as exc:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise ModelLoadError(f"inconsistent GGUF tokenizer vocabulary: {exc}") from exc


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ModelLoadError(f"malformed GGUF merge rule {merge!r} (expected 'left right')")
    return left, right


def _sentencepiece_bpe(tokens: list[str], token_types: list[int], metadata: Mapping[str, Any]) -> Backend:
    """SentencePiece BPE (Llama 1/2, Mistral...): merges ranked by the merged piece's score."""
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    mergeable = [TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED]
    merges = _merges_from_scores(
        [(t, s) for t, s, k in zip(tokens, scores, token_types) if k in mergeable], vocab)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Backend(_bpe_model(vocab=vocab, merges=merges, unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_UNDERLINE, prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(scored: list[tuple[str, float]], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's "merge the best-scoring pair" rule.

    Every way of cutting a piece into two pieces of the vocabulary is a merge, ranked by the
    score of the piece it makes (best first), then longer left / right parts first.
    """
    candidates: list[tuple[float, int, int, str, str]] = []
    for piece, score in scored:
        cuts = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
        cuts = sorted((c for c in cuts if c[0] in vocab and c[1] in vocab),
                      key=lambda c: (vocab[c[0]], vocab[c[1]]))
        candidates.extend((score, len(left), len(right), left, right) for left, right in cuts)
    candidates.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)  # stable: ties keep id order
    return [(left, right) for _, _, _, left, right in candidates]


def _add_gguf_special_tokens(backend: Backend, tokens: list[str], token_types: list[int]) -> None:
    """Make control tokens special and user-defined tokens added, so text matches them whole."""
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)


def _set_special_post_processor(backend: Backend, tokens: list[str], bos_id: int | None,
                                eos_id: int | None) -> None:
    """Prepend BOS / append EOS on encode(add_special_tokens=True), as the file asks."""
    before = [(tokens[bos_id], bos_id)] if bos_id is not None else []
    after = [(tokens[eos_id], eos_id)] if eos_id is not None else []
    single = [f"{t}:0" for t, _ in before] + ["$A:0"] + [f"{t}:0" for t, _ in after]
    pair = single + [f"{t}:1" for t, _ in before] + ["$B:1"] + [f"{t}:1" for t, _ in after]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(before + after)))


# ============================================================================ HF directories

def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot parse {path!r}: {exc}") from exc


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _hf_chat_template(path: str, tok_config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins (transformers 5 layout), then tokenizer_config's chat_template."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


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


def _dedupe(ids: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids))
