"""Write the model as an F32 or BF16 GGUF for llama.cpp, so it runs the precision we run.

The bundled model is Q4_1; pagedllm dequantizes it on load. llama.cpp would compute on
the quantized weights, which is another workload, so the bench gives it our dequantized
weights instead: each tensor dequantized with pagedllm's own dequantizer, kept in GGUF
layout (q/k stay permuted the way llama.cpp expects), written with the `gguf` package's
writer. 1-D tensors (norms) stay F32, as llama.cpp's own converter keeps them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from pagedllm.loader.dequant import dequantize

logger = logging.getLogger(__name__)

_TARGETS = {"float32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
            "bfloat16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16)}
# Keys the writer sets itself or that describe the source file's encoding.
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type")
_CONVERTER_VERSION = 2  # part of the cache key: a fixed converter never reuses an old file


def gguf_cache_path(src: str, dtype: str, cache_dir: str | None = None) -> str:
    """Where the converted file lives: keyed by the source's path, size and mtime."""
    st = os.stat(src)
    key = hashlib.sha1(f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}:{_CONVERTER_VERSION}".encode()).hexdigest()[:12]
    directory = cache_dir or os.path.join(tempfile.gettempdir(), "pagedllm-bench-gguf")
    stem = os.path.splitext(os.path.basename(src))[0]
    return os.path.join(directory, f"{stem}-{key}.{_TARGETS[dtype][0].name}.gguf")


def convert_gguf(src: str, dst: str, dtype: str) -> str:
    """Write ``src`` with every tensor dequantized to ``dtype`` (float32 or bfloat16)."""
    if dtype not in _TARGETS:
        raise ValueError(f"llama.cpp GGUF dtype must be one of {list(_TARGETS)}, got {dtype!r}")
    qtype, file_type = _TARGETS[dtype]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = dst + ".part"
    writer = GGUFWriter(tmp, arch)
    _copy_metadata(reader, writer)
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape.tolist())]  # GGUF ne order is reversed
        weight = dequantize(tensor.data, tensor.tensor_type, shape, tensor.name).numpy()
        target = qtype if weight.ndim > 1 else GGMLQuantizationType.F32
        data = quantize(weight, target) if target != GGMLQuantizationType.F32 else weight
        # BF16 comes back as raw bytes; the writer derives the element shape from them.
        writer.add_tensor(tensor.name, data, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith(_SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)


def gguf_for_dtype(src: str, dtype: str) -> str:
    """The model as a GGUF llama.cpp can run in ``dtype``, converted once and cached."""
    if not src.endswith(".gguf"):
        raise ValueError(f"llama.cpp needs a GGUF model; {src!r} is not one (pass --llama-gguf)")
    dst = gguf_cache_path(src, dtype)
    if not os.path.exists(dst):
        logger.info("writing %s weights of %s for llama.cpp to %s", dtype, src, dst)
        convert_gguf(src, dst, dtype)
    return dst
