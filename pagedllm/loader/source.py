"""What every loader returns: config, tokenizer and a way to stream the weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from gguf import GGMLQuantizationType

from pagedllm.models.config import ModelConfig
from pagedllm.tokenizer import Tokenizer

from pagedllm.layers.quantized import GGUFWeight

# (dtype, the GGUF types to keep quantized) -> (HF name, tensor or GGUFWeight) pairs
WeightStream = Callable[[torch.dtype, frozenset[GGMLQuantizationType]],
                        Iterator[tuple[str, torch.Tensor | GGUFWeight]]]


@dataclass
class ModelSource:
    """A model on disk, opened but with its weights not yet read.

    Attributes:
        path: the file or directory the model came from.
        format: "gguf" or "hf".
        config: the model's hyper-parameters.
        tokenizer: its tokenizer (chat template and stop tokens included).
        weight_names: the HF names ``weights()`` will yield, in order.
        tensor_types: a GGUF's tensor types (ggml types; empty for other formats).
    """

    path: str
    format: str
    config: ModelConfig
    tokenizer: Tokenizer
    weight_names: list[str]
    _stream: WeightStream = field(repr=False)
    tensor_types: frozenset[GGMLQuantizationType] = frozenset()
    # a GGUF's (type, elements, bytes) of each weight tensor, for the memory check
    tensor_sizes: list[tuple[GGMLQuantizationType, int, int]] = field(default_factory=list)

    def kept_size(self, keep: frozenset[GGMLQuantizationType]) -> tuple[int, int]:
        """(elements, file bytes) of the weights of the types in keep."""
        sizes = [(n, b) for t, n, b in self.tensor_sizes if t in keep]
        return sum(n for n, _ in sizes), sum(b for _, b in sizes)

    def weights(self, dtype: torch.dtype = torch.float32,
                keep: frozenset[GGMLQuantizationType] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        """Yield ``(hf_name, tensor)`` pairs one at a time, dequantized and cast to ``dtype``;
        a GGUF's 2-D weights of the types in ``keep`` as GGUFWeights, as the file stores them.

        Only one tensor is materialised at a time, so the caller can copy each into the
        model and drop it without ever holding two copies of the weights.
        """
        return self._stream(dtype, keep)
