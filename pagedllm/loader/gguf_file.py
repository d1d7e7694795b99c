"""Reading a GGUF file: its metadata decoded to Python values and its tensors' places, in one
bounds-checked pass over the header; tensor data stays in the memory-mapped file.

    magic "GGUF", version u32 (2 or 3), tensor_count u64, kv_count u64
    kv_count x   key: string, value_type: u32, value
    tensor_count x   name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64
    padding to general.alignment (default 32), then the tensor data

(a string is u64 length + UTF-8 bytes; an array is element type u32 + count u64 + elements).

Every count and length is checked against the bytes that remain before it is used, and what
a well-formed file never holds is refused with a ModelLoadError naming the file, the byte
offset and the field: a file that declares 2**63 array elements or a tensor past its end
fails at once instead of looping, allocating or reading garbage. (gguf-py's GGUFReader
trusts the declared lengths, and builds a numpy view per field part: 6-12 s for a
128k-token vocabulary, where this pass takes well under a second.)
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from pagedllm.utils import cdiv

from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535           # the GGUF spec's limit on key length
MAX_TENSOR_NAME_BYTES = 256     # llama.cpp itself allows 63 (GGML_MAX_NAME)
MAX_ARRAY_DEPTH = 2             # an array of arrays at most; no key we know nests at all
# Vocabularies are the longest arrays real files hold (~262k tokens): a declared count far
# beyond that is refused up front.
MAX_ARRAY_ELEMENTS = 1 << 22
MAX_TENSOR_ELEMENTS = 1 << 40

# scalar value types: struct format and numpy dtype (little-endian; the reader swaps)
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_MIN_KV_BYTES = 8 + 4 + 1            # empty key, type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8   # empty name, n_dims, one dim, type, offset


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. shape is GGUF's ne (the row length first), as gguf-py's
    ReaderTensor.shape; data is the tensor's bytes (uint8, a view of the mapped file)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]     # every key/value, decoded (float32 as its shortest decimal)
    tensors: list[GGUFTensor]    # in the file's order


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file (ModelLoadError if it is malformed, truncated or absurd)."""
    if os.path.getsize(path) == 0:
        raise ModelLoadError(f"{path!r} is not a valid GGUF file: it is empty")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        metadata, infos, data_start = _parse(_Cursor(buf, path))
    tensors = [GGUFTensor(name, qtype, dims, n_elements, n_bytes,
                          data[data_start + offset:data_start + offset + n_bytes])
               for name, qtype, dims, n_elements, offset, n_bytes in infos]
    return GGUFFile(path, metadata, tensors)


def parse_gguf_bytes(data: bytes, path: str = "<bytes>") -> dict[str, Any]:
    """The metadata of a GGUF file held in memory, with every check read_gguf makes (tests,
    fuzzing)."""
    return _parse(_Cursor(data, path))[0]


class _Cursor:
    """A position in the file's bytes whose every read is bounds-checked."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0
        self.size = len(buf)

    def fail(self, message: str, at: int | None = None) -> ModelLoadError:
        at = self.pos if at is None else at
        return ModelLoadError(f"{self.path!r} is not a valid GGUF file: {message} (at byte {at} "
                              f"of {self.size})")

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.remaining:
            raise self.fail(f"{what} needs {n} bytes but only {self.remaining} remain; the file "
                            f"is truncated or a length or count is corrupt")
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def string(self, what: str, max_bytes: int | None = None) -> bytes:
        at = self.pos
        n = self.u64(f"length of {what}")
        if max_bytes is not None and n > max_bytes:
            raise self.fail(f"{what} is {n} bytes long (at most {max_bytes} allowed)", at)
        return self.take(n, what)

    def text(self, what: str, max_bytes: int | None = None) -> str:
        at = self.pos
        raw = self.string(what, max_bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} {raw[:40]!r} is not valid UTF-8", at) from None


def _parse(r: _Cursor) -> tuple[dict[str, Any], list[tuple], int]:
    if r.size < 4 or r.take(4, "magic") != GGUF_MAGIC:
        raise r.fail("wrong magic (expected b'GGUF')", 0)
    version = r.u32("version")
    if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
        raise r.fail("the file was written big-endian; pagedllm (like llama.cpp on this "
                     "machine) reads little-endian GGUF files", 4)
    if version not in SUPPORTED_VERSIONS:
        raise r.fail(f"unsupported GGUF version {version} (supported: 2, 3)", 4)
    tensor_count = r.u64("tensor count")
    kv_count = r.u64("metadata key/value count")
    if kv_count * _MIN_KV_BYTES > r.remaining:
        raise r.fail(f"metadata key/value count {kv_count} cannot fit in the file")
    if tensor_count * _MIN_TENSOR_INFO_BYTES > r.remaining:
        raise r.fail(f"tensor count {tensor_count} cannot fit in the file")
    metadata = _read_metadata(r, kv_count)
    alignment = _alignment(r, metadata)
    infos = _read_tensor_infos(r, tensor_count, alignment)
    data_start = cdiv(r.pos, alignment) * alignment
    for name, _, _, _, offset, n_bytes in infos:
        end = data_start + offset + n_bytes
        if end > r.size:
            raise r.fail(f"tensor {name!r} data [{data_start + offset}, {end}) runs past the end "
                         f"of the file; it is truncated or the offset is corrupt")
    return metadata, infos, data_start


def _read_metadata(r: _Cursor, kv_count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        at = r.pos
        name = r.text("metadata key", MAX_KEY_BYTES)
        if name in metadata:
            raise r.fail(f"metadata key {name!r} appears twice", at)
        value_type = _value_type(r, r.u32(f"type of {name!r}"), name)
        metadata[name] = _read_value(r, value_type, name, depth=0)
    return metadata


def _value_type(r: _Cursor, raw: int, name: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise r.fail(f"{name!r} has unknown value type {raw}", r.pos - 4) from None


def _read_value(r: _Cursor, value_type: GGUFValueType, name: str, depth: int) -> Any:
    if value_type in _SCALARS:
        value = r.scalar(_SCALARS[value_type], f"value of {name!r}")
        return _float32(value) if value_type == GGUFValueType.FLOAT32 else value
    if value_type == GGUFValueType.STRING:
        return r.text(f"string value of {name!r}")
    return _read_array(r, name, depth)


def _read_array(r: _Cursor, name: str, depth: int) -> list[Any]:
    at = r.pos
    if depth >= MAX_ARRAY_DEPTH:
        raise r.fail(f"{name!r} nests arrays deeper than {MAX_ARRAY_DEPTH} levels", at)
    element_type = _value_type(r, r.u32(f"element type of {name!r}"), name)
    count = r.u64(f"length of array {name!r}")
    if count > MAX_ARRAY_ELEMENTS:
        raise r.fail(f"array {name!r} declares {count} elements (at most {MAX_ARRAY_ELEMENTS})", at)
    if element_type in _SCALARS:
        fmt = _SCALARS[element_type]
        raw = r.take(count * struct.calcsize(fmt), f"{count} elements of array {name!r}")
        values = np.frombuffer(raw, dtype=np.dtype("<" + fmt if fmt != "?" else "?"))
        if element_type == GGUFValueType.FLOAT32:
            return [_float32(v) for v in values.tolist()]
        if element_type == GGUFValueType.BOOL:
            return [bool(v) for v in values]
        return values.tolist()
    min_size = 8 if element_type == GGUFValueType.STRING else 12
    if count * min_size > r.remaining:
        raise r.fail(f"array {name!r} declares {count} elements, more than the file can hold", at)
    if element_type == GGUFValueType.STRING:
        return _read_strings(r, count, name)
    return [_read_value(r, element_type, name, depth + 1) for _ in range(count)]


def _read_strings(r: _Cursor, count: int, name: str) -> list[str]:
    """The hot loop (a vocabulary is 50-260k strings): no calls per string but the slice."""
    buf, size, pos = r.buf, r.size, r.pos
    unpack = struct.Struct("<Q").unpack_from
    out = []
    try:
        for i in range(count):
            if pos + 8 > size:
                r.pos = pos
                raise r.fail(f"string {i} of array {name!r} is cut off by the end of the file")
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                r.pos = pos
                raise r.fail(f"string {i} of array {name!r} runs past the end of the file")
            out.append(buf[pos + 8:end].decode("utf-8"))
            pos = end
    except UnicodeDecodeError:
        raise r.fail(f"string {len(out)} of array {name!r} is not valid UTF-8", pos) from None
    r.pos = pos
    return out


def _float32(value: float) -> float:
    """A float32 as the shortest decimal that round-trips (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _alignment(r: _Cursor, metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise r.fail(f"general.alignment {value!r} is not a power of two")
    return value


def _read_tensor_infos(r: _Cursor, count: int, alignment: int) -> list[tuple]:
    """(name, type, dims, elements, data offset, bytes) of each tensor."""
    infos: list[tuple] = []
    names: set[str] = set()
    for _ in range(count):
        at = r.pos
        name = r.text("tensor name", MAX_TENSOR_NAME_BYTES)
        if name in names:
            raise r.fail(f"tensor {name!r} appears twice", at)
        names.add(name)
        n_dims = r.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", at)
        dims = tuple(r.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims))
        raw_type = r.u32(f"type of tensor {name!r}")
        offset = r.u64(f"data offset of tensor {name!r}")
        qtype, n_elements, n_bytes = _tensor_size(r, name, dims, raw_type, at)
        if offset % alignment:
            raise r.fail(f"tensor {name!r} data offset {offset} is not a multiple of the "
                         f"alignment {alignment}", at)
        infos.append((name, qtype, dims, n_elements, offset, n_bytes))
    return infos


def _tensor_size(r: _Cursor, name: str, dims: tuple[int, ...], raw_type: int,
                 at: int) -> tuple[GGMLQuantizationType, int, int]:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise r.fail(f"tensor {name!r} has unknown ggml type id {raw_type}", at) from None
    if any(d == 0 for d in dims):
        raise r.fail(f"tensor {name!r} has a zero dimension {list(dims)}", at)
    n_elements = 1
    for d in dims:
        n_elements *= d
    if n_elements > MAX_TENSOR_ELEMENTS:
        raise r.fail(f"tensor {name!r} declares {n_elements} elements (shape {list(dims)})", at)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block_size:
        raise r.fail(f"tensor {name!r} ({qtype.name}) has rows of {dims[0]} elements, not a "
                     f"multiple of its block size {block_size}", at)
    return qtype, n_elements, n_elements // block_size * type_size
