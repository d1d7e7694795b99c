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
