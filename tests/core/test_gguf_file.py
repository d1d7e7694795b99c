"""Our GGUF reader (loader/gguf_file.py) against gguf-py's GGUFReader, the reference: the same
metadata values and the same tensors (names, types, shapes, bytes) for the bundled model and
for files holding every value type; clear errors for what it refuses. (Hostile and truncated
headers: test_loader_fuzz.py.)"""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType

from pagedllm.loader import ModelLoadError, default_model_path
from pagedllm.loader.gguf_file import parse_gguf_bytes, read_gguf


def reference_metadata(reader: gguf.GGUFReader) -> dict:
    """gguf-py's fields as plain Python values (float32 as its shortest decimal)."""
    def float32(v) -> float:
        return float(str(np.float32(v)))

    def scalar(part, kind):
        if kind == GGUFValueType.FLOAT32:
            return float32(part[0])
        return bool(part[0]) if kind == GGUFValueType.BOOL else part[0].item()

    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # gguf-py's own entries for the header's counts
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            element = field.types[-1]
            if element == GGUFValueType.STRING:
                out[key] = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                out[key] = [scalar(field.parts[i], element) for i in field.data]
        elif kind == GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode()
        else:
            out[key] = scalar(field.parts[field.data[0]], kind)
    return out


def assert_same_as_reference(path: str) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert ours.metadata == reference_metadata(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes) == (
            b.tensor_type, tuple(int(d) for d in b.shape), int(b.n_elements), int(b.n_bytes))
        assert np.array_equal(a.data, np.ascontiguousarray(b.data).reshape(-1).view(np.uint8))


def test_the_bundled_model_reads_as_gguf_py_reads_it():
    assert_same_as_reference(default_model_path())


def test_every_value_type_and_tensor_type(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 1e-5)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 🙂")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1e-6, 3.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 32), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    blocks = rng.integers(0, 256, (4, 2 * 18), dtype=np.uint8)
    writer.add_tensor("q4_0", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_reference(str(path))
    meta = read_gguf(str(path)).metadata
    assert meta["t.u64"] == 2**63 + 5 and meta["t.f32"] == 1e-05 and meta["t.bools"] == [True, False]


def header(version: int = 3, tensors: int = 0, kvs: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def kv_string_array(key: bytes, strings: list[bytes]) -> bytes:
    body = b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    return (struct.pack("<Q", len(key)) + key + struct.pack("<I", GGUFValueType.ARRAY)
            + struct.pack("<IQ", GGUFValueType.STRING, len(strings)) + body)


@pytest.mark.parametrize("data, message", [
    (b"GGML" + bytes(20), "wrong magic"),
    (header(version=1), "unsupported GGUF version 1"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 1), "written big-endian"),
    (header() + kv_string_array(b"k", [b"ok", b"\xff\xfe"]), "string 1 of array 'k' is not valid UTF-8"),
    (header() + kv_string_array(b"k", [b"ok"])[:-1], "runs past the end of the file"),
    (header(kvs=2) + kv_string_array(b"k", []) * 2, "metadata key 'k' appears twice"),
])
def test_malformed_headers_are_refused_by_name(data, message):
    with pytest.raises(ModelLoadError, match=message):
        parse_gguf_bytes(data, "bad.gguf")


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="it is empty"):
        read_gguf(str(path))
