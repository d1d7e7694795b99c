"""Sequence: one stream of tokens and the block table that maps it onto the KV cache."""
from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import Any

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()   # preempted with its KV copied to the swap pool
    FINISHED = auto()


class TokenView:
    """The prompt / completion split of token_ids, for anything holding both attributes."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class Sequence(TokenView):
    """A request's tokens (prompt + generated) and its logical -> physical block map.

    block_table[i] is the physical block holding tokens [i * block_size, (i + 1) * block_size).
    num_cached_tokens is how many leading tokens were found in the prefix cache at
    allocation and are not recomputed; num_computed_tokens is how many leading tokens have
    their KV in the cache (cached + computed by earlier steps or chunks). The tokens
    [num_computed_tokens, len) are what the next step computes: the rest of a prompt (in
    chunks) or the one newest sampled token, then any draft tokens (spec_token_ids) to verify.
    """

    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 request_id: str | None = None, arrival_time: float = 0.0,
                 generator_device: str = "cpu") -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.block_size = block_size
        self.block_table: list[int] = []
        self.swap_table: list[int] = []     # swap-pool blocks holding its KV while SWAPPED
        self.block_hashes: list[int] = []   # chained hashes of full blocks, filled lazily
        self.sampling_params = sampling_params
        # A seeded request samples from its own generator: reproducible in any batch. It lives
        # where the sampler runs (the model's device), so the noise is drawn there.
        self.generator_device = generator_device
        self.generator = (torch.Generator(generator_device).manual_seed(sampling_params.seed)
                          if sampling_params.seed is not None else None)
        self.finish_reason: str | None = None   # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        # Parallel sampling (n > 1): the other samples of this request, forked from this
        # sequence when its prompt is computed; they share its blocks until they diverge.
        self.pending_forks: list[Sequence] = []
        self.sample_index = 0   # which of the request's n samples (or beams) this is
        # Beam search: log-prob sum of the generated tokens, and the next token's log-probs
        # once computed (until the request's beams all have theirs and advance together).
        self.cum_logprob = 0.0
        self.beam_logprobs: torch.Tensor | None = None
        # Token controls: the grammar matcher of a structured output (it has taken every
        # sampled token), and the bad words' token ids (SamplingParams.bad_words).
        self.grammar: Any = None
        self.bad_words_token_ids: list[list[int]] = []
        # SamplingParams.prompt_logprobs: one entry per prompt token computed so far
        self.prompt_logprobs: list[Any] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        # SamplingParams.pooling: the prompt's hidden states pooled so far (fp32 sum for mean,
        # the last token's for last) and how many prompt tokens they cover
        self.pooled: torch.Tensor | None = None
        self.num_pooled_tokens = 0
        # Speculative decoding: draft tokens this step verifies after the last token (their
        # KV slots are allocated; they are not tokens of the sequence until accepted), and
        # how many drafts (verified rows) and draft tokens were proposed and accepted over
        # its life.
        self.spec_token_ids: list[int] = []
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.spec_acceptance = 1.0   # recent accepted / proposed (spec_decode/control.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_beam(self) -> bool:
        return self.sampling_params.use_beam_search

    @property
    def is_prefill(self) -> bool:
        """Whether more than the newest token is still to be computed (a prompt or a recompute)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def num_blocks(self) -> int:
        return cdiv(len(self.token_ids), self.block_size)

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i."""
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, sampling_params: SamplingParams | None = None,
             request_id: str | None = None) -> "Sequence":
        """A copy with the same tokens and progress, and no blocks yet (BlockManager.fork
        shares them); its own generator comes from sampling_params' seed."""
        child = Sequence(self.token_ids, sampling_params or self.sampling_params, self.block_size,
                         request_id if request_id is not None else self.request_id,
                         self.arrival_time, self.generator_device)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.first_token_time = self.first_token_time
        child.cum_logprob = self.cum_logprob
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, {self.status.name}, "
                f"tokens={len(self)}, computed={self.num_computed_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")
