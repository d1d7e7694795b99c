"""Errors raised while loading a model or its tokenizer."""
from __future__ import annotations

import contextlib
from typing import Iterator


class ModelLoadError(ValueError):
    """A model path, file or its contents cannot be loaded.

    Subclasses ValueError so callers that validate user input with ``except ValueError``
    keep working; the message always names the offending path, key, tensor or type.
    """


@contextlib.contextmanager
def naming_errors(path: str, what: str) -> Iterator[None]:
    """Turn any error raised inside into a ModelLoadError naming the file and the stage.

    Used where values read from a (possibly hostile) file flow into int(), numpy or
    tokenizers, whose own errors would not say which file or what was wrong with it.
    """
    try:
        yield
    except ModelLoadError as exc:
        if path in str(exc):
            raise
        raise ModelLoadError(f"{path!r}: {what}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"{path!r}: {what}: {type(exc).__name__}: {exc}") from exc
