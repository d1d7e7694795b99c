"""The attention Context: what the current step's attention layers need to find their KV.

Set by the ModelRunner before the forward pass and read by every Attention layer, so the
model code keeps the plain (positions, hidden_states) interface (as in nano-vllm).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Context:
    """One step's attention metadata. Each row (sequence) of the batch computes seqlens_q[i]
    new tokens after seqlens_k[i] - seqlens_q[i] tokens already in the cache (a cached
    prefix, earlier chunks, or its whole past for a decode). The first num_decodes rows
    have one new token (decodes) and may take a batched decode kernel; is_prefill says
    whether any row has more (a prompt or a chunk of one), so a batch can be mixed.
    """

    is_prefill: bool = False
    num_decodes: int = 0
    # Prefill: cumulative query / key lengths of the packed sequences ([num_seqs + 1]).
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # Cache slot (block_id * block_size + offset) of every new token; -1 = don't store.
    slot_mapping: torch.Tensor | None = None
    # Tokens each decode row attends to, including the new one ([num_decodes]; with
    # is_prefill False every row is a decode).
    context_lens: torch.Tensor | None = None
    # [num_seqs, max_blocks] physical block ids, -1 padded, for every row (a prefill row
    # without cached tokens may ignore it).
    block_tables: torch.Tensor | None = None
    # Host copies of the lengths, so CPU kernels need not sync or convert.
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    # Per-step scratch of the attention backend: what it works out from the above in the
    # first layer (which rows take which path, a shared prefix) and reuses in the others.
    backend_plans: dict[object, object] = field(default_factory=dict)


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(**kwargs: object) -> Context:
    global _CONTEXT
    _CONTEXT = Context(**kwargs)  # type: ignore[arg-type]
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
