"""Architecture name -> model class, and the names checkpoints use for each architecture."""
from __future__ import annotations

from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
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
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
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
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# (model_type "gemma3" is the multimodal model: see UNSUPPORTED_HF_ARCHITECTURES)
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                  "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}
# config.json "architectures" entries and "model_type" values we know and refuse, with why
UNSUPPORTED_HF_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "a Gemma 3 multimodal (image and text) checkpoint "
    "(Gemma3ForConditionalGeneration); pagedllm runs the text model only: Gemma3ForCausalLM "
    "(model_type gemma3_text), e.g. google/gemma-3-1b-it, or a GGUF of the language model",
}
UNSUPPORTED_HF_MODEL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration"}
# llama.cpp's general.architecture values (Mistral converts as "llama", and Mixtral as
# "llama" with an expert count: the GGUF loader tells it apart)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3": "gemma3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe"}
# llama.cpp's sliding window pattern (pattern_layer_types) where a GGUF gives none; HF 4.x
# configs without layer_types have the same defaults
SLIDING_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6}
# architectures whose q, k and v projections always have biases (and o's none)
QKV_BIAS_ARCHITECTURES = frozenset({"qwen2", "qwen2_moe"})


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(MODELS)}") from None
