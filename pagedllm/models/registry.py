"""Architecture name -> model class."""
from __future__ import annotations

from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(MODELS)}") from None
