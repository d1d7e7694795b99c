"""A bounds-checking pass over a GGUF file's header, before ``gguf.GGUFReader`` reads it.

``GGUFReader`` trusts the counts and lengths a file declares. Past the end of the file its
reads come back empty instead of failing, so an array header that declares 2**63 scalar
elements makes it loop (and allocate) essentially forever; a huge tensor count, string
length or dimension turns into a raw numpy error at best. This pass walks the same
structure with every length checked against the bytes that remain, and rejects what a
well-formed file never holds, with a ModelLoadError that names the file, the byte offset
and the field:

    magic "GGUF", version u32 (2 or 3), tensor_count u64, kv_count u64
    kv_count x   key: string, value_type: u32, value
    tensor_count x   name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64
    padding to general.alignment (default 32), then the tensor data

(a string is u64 length + UTF-8 bytes; an array is element type u32 + count u64 + elements).
It reads the header only: for a 100 MB model that is the vocabulary, a few MB.
"""
from __future__ import annotations

import mmap
import os
import struct

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
# Vocabularies are the longest arrays real files hold (~262k tokens); gguf-py decodes an
# array element by element, so a declared count far beyond that is refused up front.
MAX_ARRAY_ELEMENTS = 1 << 22
MAX_TENSOR_ELEMENTS = 1 << 40

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_MIN_KV_BYTES = 8 + 4 + 1            # empty key, type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8   # empty name, n_dims, one dim, type, offset


class _Reader:
    """A cursor over the file's bytes whose every read is bounds-checked."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0
        self.size = len(buf)
        self.endian = "<"

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
                            f"is truncated or the length is corrupt")
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        return data

    def u32(self, what: str) -> int:
        return struct.unpack(self.endian + "I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack(self.endian + "Q", self.take(8, what))[0]

    def string(self, what: str, max_bytes: int | None = None) -> bytes:
        at = self.pos
        n = self.u64(f"length of {what}")
        if max_bytes is not None and n > max_bytes:
            raise self.fail(f"{what} is {n} bytes long (at most {max_bytes} allowed)", at)
        return self.take(n, what)

    def skip(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise self.fail(f"{what} needs {n} bytes but only {self.remaining} remain; the file "
                            f"is truncated or a count is corrupt")
        self.pos += n


def scan_gguf(path: str) -> None:
    """Raise ModelLoadError if the GGUF header of ``path`` is malformed, truncated or absurd."""
    size = os.path.getsize(path)
    if size == 0:
        raise ModelLoadError(f"{path!r} is not a valid GGUF file: it is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _scan(_Reader(buf, path))


def scan_gguf_bytes(data: bytes, path: str = "<bytes>") -> None:
    """scan_gguf on bytes in memory (tests, fuzzing)."""
    _scan(_Reader(data, path))


def _scan(r: _Reader) -> None:
    if r.size < 4 or r.take(4, "magic") != GGUF_MAGIC:
        raise r.fail("wrong magic (expected b'GGUF')", 0)
    version_bytes = r.take(4, "version")
    version = struct.unpack("<I", version_bytes)[0]
    if version & 0xFFFF == 0:           # written on a big-endian machine
        r.endian = ">"
        version = struct.unpack(">I", version_bytes)[0]
    if version not in SUPPORTED_VERSIONS:
        raise r.fail(f"unsupported GGUF version {version} (supported: 2, 3)", 4)
    tensor_count = r.u64("tensor count")
    kv_count = r.u64("metadata key/value count")
    if kv_count * _MIN_KV_BYTES > r.remaining:
        raise r.fail(f"metadata key/value count {kv_count} cannot fit in the file")
    if tensor_count * _MIN_TENSOR_INFO_BYTES > r.remaining:
        raise r.fail(f"tensor count {tensor_count} cannot fit in the file")
    alignment = _scan_metadata(r, kv_count)
    tensors = _scan_tensor_infos(r, tensor_count, alignment)
    data_start = cdiv(r.pos, alignment) * alignment
    _check_tensor_data(r, tensors, data_start)


def _scan_metadata(r: _Reader, kv_count: int) -> int:
    """Walk the key/values; return the data alignment (general.alignment or 32)."""
    keys: set[bytes] = set()
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        at = r.pos
        key = r.string("metadata key", MAX_KEY_BYTES)
        name = _utf8(r, key, "metadata key", at)
        if key in keys:
            raise r.fail(f"metadata key {name!r} appears twice", at)
        keys.add(key)
        value_type = _value_type(r, r.u32(f"type of {name!r}"), name)
        value_at = r.pos
        _skip_value(r, value_type, name, depth=0)
        if name == "general.alignment":
            alignment = _alignment(r, value_type, value_at)
    return alignment


def _value_type(r: _Reader, raw: int, name: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise r.fail(f"{name!r} has unknown value type {raw}", r.pos - 4) from None


def _skip_value(r: _Reader, value_type: GGUFValueType, name: str, depth: int) -> None:
    if value_type in _SCALAR_SIZES:
        r.skip(_SCALAR_SIZES[value_type], f"value of {name!r}")
    elif value_type == GGUFValueType.STRING:
        r.string(f"string value of {name!r}")
    else:  # ARRAY
        _skip_array(r, name, depth)


def _skip_array(r: _Reader, name: str, depth: int) -> None:
    at = r.pos
    if depth >= MAX_ARRAY_DEPTH:
        raise r.fail(f"{name!r} nests arrays deeper than {MAX_ARRAY_DEPTH} levels", at)
    element_type = _value_type(r, r.u32(f"element type of {name!r}"), name)
    count = r.u64(f"length of array {name!r}")
    if count > MAX_ARRAY_ELEMENTS:
        raise r.fail(f"array {name!r} declares {count} elements (at most {MAX_ARRAY_ELEMENTS})", at)
    if element_type in _SCALAR_SIZES:
        r.skip(count * _SCALAR_SIZES[element_type], f"{count} elements of array {name!r}")
        return
    min_size = 8 if element_type == GGUFValueType.STRING else 12
    if count * min_size > r.remaining:
        raise r.fail(f"array {name!r} declares {count} elements, more than the file can hold", at)
    if element_type == GGUFValueType.STRING:
        _skip_strings(r, count, name)
        return
    for _ in range(count):
        _skip_value(r, element_type, name, depth + 1)


def _skip_strings(r: _Reader, count: int, name: str) -> None:
    """The hot loop of the scan (a vocabulary is ~100k strings): no copies, no calls."""
    buf, size, fmt, pos = r.buf, r.size, r.endian + "Q", r.pos
    for i in range(count):
        if pos + 8 > size:
            r.pos = pos
            raise r.fail(f"string {i} of array {name!r} is cut off by the end of the file")
        pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
        if pos > size:
            raise r.fail(f"string {i} of array {name!r} runs past the end of the file")
    r.pos = pos


def _alignment(r: _Reader, value_type: GGUFValueType, at: int) -> int:
    if value_type != GGUFValueType.UINT32:
        raise r.fail(f"general.alignment must be a uint32, not {value_type.name}", at)
    value = struct.unpack(r.endian + "I", r.buf[at:at + 4])[0]
    if value == 0 or value & (value - 1):
        raise r.fail(f"general.alignment {value} is not a power of two", at)
    return value


def _scan_tensor_infos(r: _Reader, count: int, alignment: int) -> list[tuple[str, int, int, int]]:
    """Walk the tensor infos; return (name, offset, n_bytes, info position) of each."""
    tensors: list[tuple[str, int, int, int]] = []
    names: set[str] = set()
    for _ in range(count):
        at = r.pos
        name = _utf8(r, r.string("tensor name", MAX_TENSOR_NAME_BYTES), "tensor name", at)
        if name in names:
            raise r.fail(f"tensor {name!r} appears twice", at)
        names.add(name)
        n_dims = r.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", at)
        dims = [r.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
        raw_type = r.u32(f"type of tensor {name!r}")
        offset = r.u64(f"data offset of tensor {name!r}")
        n_bytes = _tensor_bytes(r, name, dims, raw_type, at)
        if offset % alignment:
            raise r.fail(f"tensor {name!r} data offset {offset} is not a multiple of the "
                         f"alignment {alignment}", at)
        tensors.append((name, offset, n_bytes, at))
    return tensors


def _tensor_bytes(r: _Reader, name: str, dims: list[int], raw_type: int, at: int) -> int:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise r.fail(f"tensor {name!r} has unknown ggml type id {raw_type}", at) from None
    if any(d == 0 for d in dims):
        raise r.fail(f"tensor {name!r} has a zero dimension {dims}", at)
    n_elements = 1
    for d in dims:
        n_elements *= d
    if n_elements > MAX_TENSOR_ELEMENTS:
        raise r.fail(f"tensor {name!r} declares {n_elements} elements (shape {dims})", at)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block_size:
        raise r.fail(f"tensor {name!r} ({qtype.name}) has rows of {dims[0]} elements, not a "
                     f"multiple of its block size {block_size}", at)
    return n_elements // block_size * type_size


def _check_tensor_data(r: _Reader, tensors: list[tuple[str, int, int, int]], data_start: int) -> None:
    for name, offset, n_bytes, at in tensors:
        end = data_start + offset + n_bytes
        if end > r.size:
            raise r.fail(f"tensor {name!r} data [{data_start + offset}, {end}) runs past the end "
                         f"of the file; it is truncated or the offset is corrupt", at)


def _utf8(r: _Reader, raw: bytes, what: str, at: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise r.fail(f"{what} {raw[:40]!r} is not valid UTF-8", at) from None
