"""pagedllm: an LLM inference and serving engine built around PagedAttention."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput",
           "CompletionOutput"]

_EXPORTS = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "EngineConfig": "pagedllm.config",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
}


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import pagedllm.engine.block_manager` stays light.
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
