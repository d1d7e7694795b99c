"""What every loader returns: config, tokenizer and a way to stream the weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from pagedllm.models.config import ModelConfig
from pagedllm.tokenizer import Tokenizer

WeightStream = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]
# (HF name, (quants, scales, minimums)) of each weight a GGUF stores as Q4_1
Q4_1Stream = Callable[[], Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]


@dataclass
class ModelSource:
    """A model on disk, opened but with its weights not yet read.

    Attributes:
        path: the file or directory the model came from.
        format: "gguf" or "hf".
        config: the model's hyper-parameters.
        tokenizer: its tokenizer (chat template and stop tokens included).
        weight_names: the HF names ``weights()`` will yield, in order.
    """

    path: str
    format: str
    config: ModelConfig
    tokenizer: Tokenizer
    weight_names: list[str]
    _stream: WeightStream = field(repr=False)
    _q4_1_stream: Q4_1Stream | None = field(default=None, repr=False)

    def weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` pairs one at a time, dequantized and cast to ``dtype``.

        Only one tensor is materialised at a time, so the caller can copy each into the
        model and drop it without ever holding two copies of the weights.
        """
        return self._stream(dtype)

    def q4_1_weights(self) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Yield ``(hf_name, (q, d, m))`` for each weight the file stores as GGUF Q4_1, kept
        quantized (loader/dequant.py q4_1_parts) and in HF layout; nothing for other formats."""
        return iter(()) if self._q4_1_stream is None else self._q4_1_stream()
