"""The tokenizer a GGUF file describes in its metadata (``tokenizer.ggml.*`` keys).

We rebuild what llama.cpp does: a byte-level BPE ("gpt2" model) whose pre-tokenizer splits
text with the regexes llama.cpp uses for the file's ``tokenizer.ggml.pre`` value, or a
SentencePiece-style BPE with byte fallback ("llama" model). Control and user-defined tokens
become added tokens, so ``<|im_start|>`` in chat-templated text encodes to its single id.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from pagedllm.tokenizer import Tokenizer

from .errors import ModelLoadError
from .gguf_file import GGUFFile

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


def tokenizer_from_gguf(source: GGUFFile | Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer a GGUF file describes.

    Args:
        source: the file (``gguf_file.read_gguf``) or its metadata.
    """
    metadata = source if isinstance(source, Mapping) else source.metadata
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
    return Tokenizer(backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                     chat_template=metadata.get("tokenizer.chat_template"),
                     special_tokens=special, vocab_size=len(tokens))


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
