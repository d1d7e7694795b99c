"""Errors raised while loading a model or its tokenizer."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path, file or its contents cannot be loaded.

    Subclasses ValueError so callers that validate user input with ``except ValueError``
    keep working; the message always names the offending path, key, tensor or type.
    """
