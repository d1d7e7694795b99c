"""Hostile model files: every malformed GGUF / safetensors / HF directory fails with a
ModelLoadError naming the file, never a raw exception, a hang or an out-of-memory attempt.

The seeds are a tiny but complete model (tests/tiny_models.py) written as a GGUF and as an
HF directory. Hypothesis then truncates them, flips bytes, and overwrites the fields a
parser trusts (counts, lengths, type ids, dimensions, offsets, hyper-parameters) with
absurd values. A mutant either loads and serves (the engine is built and runs a step) or
is refused with a ModelLoadError. While fuzzing, the address space is capped a couple of
GiB above what the process uses, so an attempt to allocate a hostile size fails at once
(and the test reports it) instead of taking the machine down; a per-case alarm turns a
hang into a failure.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader import ModelLoadError, load_model_source
from pagedllm.loader.gguf_file import parse_gguf_bytes
from pagedllm.loader.gguf_loader import gguf_to_hf_name
from pagedllm.sampling_params import SamplingParams
from tiny_models import write_tiny_llama_gguf

FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
CASE_SECONDS = 10          # a parse of the tiny file takes milliseconds; this is a hang
ADDRESS_SPACE_HEADROOM = 3 * 2**30
HOSTILE_INTS = [0, 1, 2, 3, 4, 5, 7, 31, 64, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


# ----------------------------------------------------------------------------- guards

class Hang(BaseException):
    """Not an Exception: the loaders' error wrapping must not turn a hang into a clean error."""


@contextlib.contextmanager
def bounded(seconds: int = CASE_SECONDS):
    """Fail (not hang) if the block runs longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise Hang(f"hang: still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@pytest.fixture(scope="module", autouse=True)
def capped_address_space():
    """Any allocation far beyond what a tiny model needs fails at once instead of swapping."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + ADDRESS_SPACE_HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def assert_clear_error(error: ModelLoadError, path: Path) -> None:
    message = str(error)
    assert path.name in message, f"the error does not name the file: {message}"
    for sign in ("MemoryError", "can't allocate", "Cannot allocate", "out of memory"):
        assert sign not in message, f"an out-of-memory attempt: {message}"


def load_and_serve(path: Path) -> None:
    """What a user does with a model path: either it fails with ModelLoadError naming the
    file, or the engine builds and runs a step."""
    with bounded():
        try:
            engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_model_len=64,
                                            kv_cache_memory_bytes=2**20, check_invariants=True))
        except ModelLoadError as e:
            assert_clear_error(e, path)
            return
        engine.add_request("probe", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()


# ----------------------------------------------------------------------------- GGUF seeds

@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory) -> bytes:
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("seed") / "seed.gguf")
    return path.read_bytes()


def _part_offset(reader: GGUFReader, part: np.ndarray) -> int:
    return part.ctypes.data - reader.data.ctypes.data


@pytest.fixture(scope="module")
def gguf_fields(gguf_seed, tmp_path_factory) -> list[tuple[str, int, int]]:
    """(description, byte offset, size) of every count, length, type id, dimension, offset
    and scalar value in the seed's header: the fields a parser has to trust."""
    path = tmp_path_factory.mktemp("fields") / "seed.gguf"
    path.write_bytes(gguf_seed)
    reader = GGUFReader(str(path))
    fields = [("tensor_count", 8, 8), ("kv_count", 16, 8)]
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        parts = field.parts
        fields += [(f"{name}: key length", _part_offset(reader, parts[0]), 8),
                   (f"{name}: value type", _part_offset(reader, parts[2]), 4)]
        if field.types[0] == GGUFValueType.ARRAY:
            fields += [(f"{name}: element type", _part_offset(reader, parts[3]), 4),
                       (f"{name}: array length", _part_offset(reader, parts[4]), 8)]
            if field.types[-1] == GGUFValueType.STRING:  # the first element's length
                fields.append((f"{name}[0]: string length", _part_offset(reader, parts[5]), 8))
        elif field.types[0] == GGUFValueType.STRING:
            fields.append((f"{name}: string length", _part_offset(reader, parts[3]), 8))
        else:
            fields.append((f"{name}: value", _part_offset(reader, parts[3]), parts[3].nbytes))
    for tensor in reader.tensors:
        name_len, _, n_dims, dims, raw_type, offset = tensor.field.parts
        fields += [(f"{tensor.name}: name length", _part_offset(reader, name_len), 8),
                   (f"{tensor.name}: n_dims", _part_offset(reader, n_dims), 4),
                   (f"{tensor.name}: ggml type", _part_offset(reader, raw_type), 4),
                   (f"{tensor.name}: data offset", _part_offset(reader, offset), 8)]
        fields += [(f"{tensor.name}: dim {i}", _part_offset(reader, dims) + 8 * i, 8)
                   for i in range(len(dims))]
    return fields


@pytest.fixture(scope="module")
def gguf_header_end(gguf_seed, tmp_path_factory) -> int:
    path = tmp_path_factory.mktemp("hdr") / "seed.gguf"
    path.write_bytes(gguf_seed)
    return int(GGUFReader(str(path)).data_offset)


def _write(tmp_dir: Path, data: bytes, name: str = "hostile.gguf") -> Path:
    path = tmp_dir / name
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutants")


def test_seed_gguf_loads_and_serves(gguf_seed, work_dir):
    path = _write(work_dir, gguf_seed, "seed.gguf")
    parse_gguf_bytes(gguf_seed)
    load_and_serve(path)
    assert load_model_source(str(path)).config.num_hidden_layers == 2


@FUZZ
@given(data=st.data())
def test_gguf_truncated_anywhere(gguf_seed, work_dir, data):
    cut = data.draw(st.integers(0, len(gguf_seed) - 1), label="cut")
    path = _write(work_dir, gguf_seed[:cut])
    with pytest.raises(ModelLoadError) as info, bounded():
        load_model_source(str(path))
    assert_clear_error(info.value, path)


@FUZZ
@given(data=st.data())
def test_gguf_header_field_set_to_hostile_value(gguf_seed, gguf_fields, work_dir, data):
    # First the kind of field (array length, dim, data offset...), then one of that kind:
    # drawing among all ~200 fields would rarely pick the few array lengths.
    kinds = sorted({label.split(": ")[-1] for label, _, _ in gguf_fields})
    kind = data.draw(st.sampled_from(kinds), label="kind")
    label, offset, size = data.draw(st.sampled_from(
        [f for f in gguf_fields if f[0].split(": ")[-1] == kind]), label="field")
    limit = 2 ** (8 * size) - 1
    value = data.draw(st.sampled_from([v for v in HOSTILE_INTS if v <= limit])
                      | st.integers(0, limit), label=f"value of {label}")
    mutant = bytearray(gguf_seed)
    mutant[offset:offset + size] = value.to_bytes(size, "little")
    load_and_serve(_write(work_dir, bytes(mutant)))


@FUZZ
@given(data=st.data())
def test_gguf_random_bytes_in_the_header(gguf_seed, gguf_header_end, work_dir, data):
    mutant = bytearray(gguf_seed)
    flips = data.draw(st.lists(st.tuples(st.integers(0, gguf_header_end - 1), st.integers(0, 255)),
                               min_size=1, max_size=16), label="flips")
    for position, value in flips:
        mutant[position] = value
    load_and_serve(_write(work_dir, bytes(mutant)))


@FUZZ
@given(body=st.binary(max_size=256), version=st.sampled_from([2, 3, 0x03000000, 7]))
def test_gguf_garbage_after_a_valid_magic(work_dir, body, version):
    path = _write(work_dir, b"GGUF" + struct.pack("<I", version) + body)
    with pytest.raises(ModelLoadError) as info, bounded():
        load_model_source(str(path))
    assert_clear_error(info.value, path)


@pytest.mark.parametrize("count", [2**22 + 1, 2**40, 2**63, 2**64 - 1])
def test_huge_scalar_array_is_refused_without_looping(work_dir, count):
    """gguf-py would iterate (and allocate) once per declared element, past the file's end."""
    key = b"tokenizer.ggml.token_type"
    header = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
              + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.UINT8, count))
    path = _write(work_dir, header + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="token_type") as info, bounded(5):
        load_model_source(str(path))
    assert_clear_error(info.value, path)


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.update({"llama.context_length": 2**40}), "GiB"),
    (lambda m: m.update({"llama.block_count": 10**9}), "layers"),
    (lambda m: m.update({"llama.embedding_length": 32}), "shape"),
    (lambda m: m.update({"llama.attention.head_count": 0}), "head_count. must be a positive"),
    (lambda m: m.update({"llama.attention.key_length": 15}), "head_dim"),
    (lambda m: m.update({"llama.block_count": "two"}), "must be a int"),
    (lambda m: m.update({"tokenizer.ggml.tokens": [1, 2, 3]}), "array of str"),
    (lambda m: m.update({"tokenizer.ggml.token_type": [1]}), "entries"),
    (lambda m: m.update({"tokenizer.ggml.merges": ["nospace"]}), "merge"),
    (lambda m: m.update({"tokenizer.ggml.model": "t5"}), "not supported"),
    (lambda m: m.update({"llama.rope.freq_base": float("nan")}), "rope_theta"),
])
def test_hostile_hyper_parameters_are_named(work_dir, mutate, message):
    """Well-formed files whose values are absurd or inconsistent with their tensors."""
    import gguf
    from tiny_models import tiny_vocab, tiny_weights
    metadata = {"llama.block_count": 2, "llama.context_length": 256, "llama.embedding_length": 64,
                "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
                "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
                "llama.rope.freq_base": 10000.0, "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "smollm"}
    tokens, types, merges = tiny_vocab()
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                     "tokenizer.ggml.merges": merges})
    mutate(metadata)
    path = work_dir / "hyper.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint64(key, value) if value >= 2**32 else writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, value in tiny_weights().items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=message) as info, bounded():
        LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_bytes=2**20))
    assert_clear_error(info.value, path)


# ----------------------------------------------------------------------------- HF directories

@pytest.fixture(scope="module")
def hf_seed(tmp_path_factory, gguf_seed) -> Path:
    """The tiny model as an HF directory: config.json, model.safetensors, tokenizer.json."""
    from tiny_models import TINY, tiny_weights
    directory = tmp_path_factory.mktemp("hf-seed")
    gguf_path = _write(directory, gguf_seed, "tiny.gguf")
    load_model_source(str(gguf_path)).tokenizer.save_pretrained(str(directory))
    os.remove(gguf_path)
    weights = {gguf_to_hf_name(name): value for name, value in tiny_weights().items()}
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 261,
        "hidden_size": TINY["hidden"], "intermediate_size": TINY["ffn"],
        "num_hidden_layers": TINY["layers"], "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"], "max_position_embeddings": TINY["context"],
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "eos_token_id": 2, "bos_token_id": 0}))
    return directory


def _hf_mutant(seed: Path, work_dir: Path) -> Path:
    target = work_dir / "hostile-hf"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(seed, target)
    return target


def test_seed_hf_dir_loads_and_serves(hf_seed):
    load_and_serve(hf_seed)


json_values = st.recursive(
    st.none() | st.booleans() | st.sampled_from(HOSTILE_INTS + [-1, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                       max_size=4),
    max_leaves=8)
CONFIG_KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
               "rope_parameters", "tie_word_embeddings", "attention_bias", "eos_token_id"]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), json_values, min_size=1, max_size=3))
def test_hf_config_values_of_any_type(hf_seed, work_dir, changes):
    path = _hf_mutant(hf_seed, work_dir)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    load_and_serve(path)


def _safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(header: dict, body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


dtypes = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3",
                          "", "F33"])
shapes = st.lists(st.sampled_from(HOSTILE_INTS[:-4] + [-1]), max_size=5)
offsets = st.lists(st.sampled_from(HOSTILE_INTS + [-1]) | st.integers(0, 2**20), min_size=0, max_size=3)


@FUZZ
@given(data=st.data())
def test_safetensors_header_fields(hf_seed, work_dir, data):
    path = _hf_mutant(hf_seed, work_dir)
    file = path / "model.safetensors"
    header, body = _safetensors_parts(file)
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names), label="tensor")
    entry = dict(header[name])
    what = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "drop", "rename"]), label="field")
    if what == "dtype":
        entry["dtype"] = data.draw(dtypes, label="dtype")
    elif what == "shape":
        entry["shape"] = data.draw(shapes, label="shape")
    elif what == "data_offsets":
        entry["data_offsets"] = data.draw(offsets, label="offsets")
    if what == "drop":
        del header[name]
    elif what == "rename":
        header[data.draw(st.text(max_size=30), label="new name")] = header.pop(name)
    else:
        header[name] = entry
    file.write_bytes(_with_header(header, body))
    load_and_serve(path)


@FUZZ
@given(data=st.data())
def test_safetensors_truncated_or_corrupted(hf_seed, work_dir, data):
    path = _hf_mutant(hf_seed, work_dir)
    file = path / "model.safetensors"
    raw = bytearray(file.read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="cut")]
    else:
        (n,) = struct.unpack("<Q", raw[:8])
        if data.draw(st.booleans(), label="hostile header length"):
            raw[:8] = struct.pack("<Q", data.draw(st.sampled_from(HOSTILE_INTS), label="length"))
        for position, value in data.draw(st.lists(st.tuples(st.integers(0, 8 + n - 1),
                                                            st.integers(0, 255)),
                                                  min_size=1, max_size=8), label="flips"):
            raw[position] = value
    file.write_bytes(bytes(raw))
    load_and_serve(path)


@pytest.mark.parametrize("weight_map, message", [
    ({"a": "../../../../etc/passwd"}, "not a file name inside"),
    ({"a": "/etc/passwd"}, "not a file name inside"),
    ({"a": 7}, "not a file name inside"),
    ([1, 2], "weight_map"),
    ({"a": "missing.safetensors"}, "missing"),
])
def test_safetensors_index_cannot_point_outside_the_directory(hf_seed, work_dir, weight_map, message):
    path = _hf_mutant(hf_seed, work_dir)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model_source(str(path))
    assert_clear_error(info.value, path)


def test_integer_weights_are_refused_not_cast(hf_seed, work_dir):
    path = _hf_mutant(hf_seed, work_dir)
    file = path / "model.safetensors"
    from safetensors.numpy import load_file
    weights = load_file(str(file))
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.int32)
    save_file(weights, str(file))
    with pytest.raises(ModelLoadError, match="'model.norm.weight' has dtype I32") as info:
        load_model_source(str(path))
    assert_clear_error(info.value, path)


def test_model_size_estimate_matches_the_built_model(gguf_seed, work_dir):
    """check_fits_in_memory counts weights and rotary caches; the real model agrees."""
    from pagedllm.loader.validate import model_bytes
    from pagedllm.models.registry import model_class
    config = load_model_source(str(_write(work_dir, gguf_seed, "size.gguf"))).config
    model = model_class(config)(config)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    assert model_bytes(config, torch.float32) == sum(t.numel() * t.element_size()
                                                     for t in tensors.values())
