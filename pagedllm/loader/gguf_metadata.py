"""GGUF metadata: every key/value of a file decoded to plain Python values."""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from .errors import naming_errors


def read_metadata(reader: GGUFReader, path: str = "<gguf>") -> dict[str, Any]:
    """All metadata key/values of a GGUF file, decoded to plain Python values."""
    with naming_errors(path, "corrupt GGUF metadata"):
        return {key: _field_value(field) for key, field in reader.fields.items()}


def _field_value(field: Any) -> Any:
    """Decode one ``ReaderField`` (works across gguf-py versions: uses parts/data/types only)."""
    if not field.types:
        return None
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        return _array_value(field)
    part = field.parts[field.data[0]]
    if main == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return _scalar(part[0], main)


def _array_value(field: Any) -> list[Any]:
    element_type = field.types[-1]
    if element_type == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    if element_type == GGUFValueType.ARRAY or not field.data:
        return []  # nested arrays: no key we read uses them
    values = np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])
    if element_type == GGUFValueType.FLOAT32:
        return [_float32(v) for v in values]
    if element_type == GGUFValueType.BOOL:
        return [bool(v) for v in values]
    return values.tolist()


def _scalar(value: np.generic, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.BOOL:
        return bool(value)
    if value_type == GGUFValueType.FLOAT32:
        return _float32(value)
    return value.item()


def _float32(value: np.generic) -> float:
    """A float32 as the shortest decimal that round-trips (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
