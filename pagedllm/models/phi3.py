"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder with partial rotary and LongRoPE
(layers/rotary.py); its checkpoints hold q/k/v and gate/up already fused, which are split
here into the merged layers' shards (so tensor parallelism splits them as Llama's)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_shapes(prefix: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        hd = config.head_dim
        rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
        return {prefix + "qkv_proj.weight": (rows, config.hidden_size)}

    @staticmethod
    def mlp_shapes(prefix: str, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "gate_up_proj.weight": (2 * ffn, hidden),
                prefix + "down_proj.weight": (hidden, ffn)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, rows in zip("qkv", tensor.split([q_rows, kv_rows, kv_rows])):
                    yield name.replace("qkv_proj", f"{part}_proj"), rows
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor
