"""Architecture name -> model class, and the names checkpoints use for each architecture."""
from __future__ import annotations

from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # Llama with a sliding window
    "qwen2": LlamaForCausalLM,    # Llama with q/k/v biases
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
}

# config.json "architectures" entries and "model_type" values -> architecture
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "phi3": "phi3"}
# llama.cpp's general.architecture values (Mistral converts as "llama")
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
# architectures whose q, k and v projections always have biases (and o's none)
QKV_BIAS_ARCHITECTURES = frozenset({"qwen2"})


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(MODELS)}") from None
