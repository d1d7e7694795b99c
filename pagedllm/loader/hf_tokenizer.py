"""The tokenizer of an HF model directory: ``tokenizer.json`` (fast tokenizers only), with
``tokenizer_config.json``, the chat template and the stop ids of ``config.json`` and
``generation_config.json``."""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from tokenizers import Tokenizer as Backend

from pagedllm.tokenizer import Tokenizer

from .errors import ModelLoadError


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
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
    return Tokenizer(backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                     chat_template=_hf_chat_template(path, tok_config), special_tokens=special)


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
