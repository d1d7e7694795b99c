"""The benchmark's random models: every preset is a config pagedllm loads as its family."""
from __future__ import annotations

import pytest

from pagedllm.bench import random_model
from pagedllm.loader.hf_loader import config_from_hf
from pagedllm.models.registry import model_class

FAMILY_OF = {"qwen3-0.6b": "qwen3", "qwen3-1.7b": "qwen3", "llama-3.2-1b": "llama",
             "llama-3.2-3b": "llama", "llama-3-8b": "llama", "qwen3-30b-a3b": "qwen3_moe",
             "qwen2.5-0.5b": "qwen2", "mistral-7b-8layers": "mistral",
             "phi-4-mini-8layers": "phi3", "gemma-3-1b": "gemma3", "gemma-2-2b": "gemma2",
             "qwen3-30b-a3b-4layers": "qwen3_moe", "mixtral-8x7b-2layers": "mixtral",
             "qwen3-tiny": "qwen3"}


@pytest.mark.parametrize("preset", sorted(random_model.PRESETS))
def test_every_preset_is_a_config_pagedllm_loads_as_its_family(preset):
    transformers = pytest.importorskip("transformers")
    config_class, kwargs = random_model.PRESETS[preset]
    hf = getattr(transformers, config_class)(**kwargs).to_dict()
    hf["architectures"] = [random_model._MODEL_CLASSES[config_class]]
    config = config_from_hf(hf, preset)
    assert config.architecture == FAMILY_OF[preset]
    model_class(config)                               # a registered class
    assert config.hidden_size == kwargs["hidden_size"]
    assert config.num_hidden_layers == kwargs["num_hidden_layers"]
