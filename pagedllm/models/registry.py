"""Architecture name -> model class, and the names checkpoints use for each architecture."""
from __future__ import annotations

from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # Llama with a sliding window
    "qwen2": LlamaForCausalLM,    # Llama with q/k/v biases
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
}

# config.json "architectures" entries and "model_type" values -> architecture
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "phi3": "phi3", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                  "mixtral": "mixtral"}
# llama.cpp's general.architecture values (Mistral converts as "llama", and Mixtral as
# "llama" with an expert count: the GGUF loader tells it apart)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# architectures whose q, k and v projections always have biases (and o's none)
QKV_BIAS_ARCHITECTURES = frozenset({"qwen2", "qwen2_moe"})


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(MODELS)}") from None
