"""The GPU suite: skipped, with the reason, where torch sees no CUDA device (CI, the 2-core
machines); on an NVIDIA GPU it checks the CUDA path against HF transformers run on the same
GPU. Run it in its own pytest process (`pytest tests/gpu`): tests/kernels sets
TRITON_INTERPRET=1 for the interpreter tests, which must not reach these."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

NO_GPU = (f"no CUDA device (torch {torch.__version__} sees none): the GPU suite runs on a "
          "machine with an NVIDIA GPU (scripts/gpu_check.sh)")
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() or os.environ.get("PAGEDLLM_GPU_SUITE_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each engine takes gpu_memory_utilization of the GPU for its KV cache: free the last
    test's before the next one profiles what is left."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
