"""Qwen3: the Llama decoder with RMSNorm on each head's q and k before RoPE."""
from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
