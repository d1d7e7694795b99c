"""Beam search over paged sequences, with HF transformers' selection rules.

Each live beam is a Sequence in the scheduler. Beams that share ancestors share their
physical blocks: a beam continued by several candidates is forked (ref counts + 1, the
partly filled last block copied on write when the forks write to it); a beam that no
candidate continues is dropped and frees its blocks. All live beams of a request advance
in lockstep: once each has its next-token log-probabilities, select() picks the next
beams exactly as transformers' `generate(num_beams=k, do_sample=False)` does (v4.56+):

* the top max(2, 1 + number of EOS ids) x k candidates of (beam score + log-prob);
* a candidate ending in EOS, or reaching max_tokens, is a finished hypothesis if it ranks
  in the top k; its score is its log-prob sum / generated_length ** length_penalty;
  the k best finished hypotheses are kept;
* the k best other candidates are the next beams;
* the search ends when no candidate can continue, or (early_stopping=True) once k
  hypotheses are finished, or (early_stopping=False, HF's default) once the best live beam
  divided by its current length ** length_penalty cannot beat the worst kept hypothesis
  ("never": judged at max_tokens when length_penalty > 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.sequence import Sequence


@dataclass
class BeamHypothesis:
    """A finished beam: its generated tokens and its length-penalised score."""

    token_ids: list[int]
    score: float
    cum_logprob: float


@dataclass
class Candidate:
    """A live beam of the next step: parent beam index, its new token, its log-prob sum."""

    parent: int
    token_id: int
    cum_logprob: float


class BeamSearchState:
    def __init__(self, beam_width: int, max_tokens: int, length_penalty: float,
                 early_stopping: bool | str, eos_token_ids: list[int]) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_token_ids = set(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width
        self.beams: list[Sequence] = []            # live beams, best first
        self.finished: list[BeamHypothesis] = []   # best first, at most beam_width
        self.num_generated = 0
        self.improvable = True
        self.done = False
        self.finish_reason: str | None = None   # "abort" or "error" if ended from outside

    def ready(self) -> bool:
        """Whether every live beam has its next-token log-probabilities."""
        return all(beam.beam_logprobs is not None for beam in self.beams)

    def select(self) -> list[Candidate]:
        """One beam step: update the finished hypotheses, return the next live beams."""
        k = self.beam_width
        cum = torch.tensor([beam.cum_logprob for beam in self.beams], dtype=torch.float32)
        logprobs = torch.stack([beam.beam_logprobs for beam in self.beams])  # type: ignore[misc]
        vocab = logprobs.shape[1]
        scores, flat = (logprobs + cum[:, None]).flatten().topk(
            min(self.num_candidates, logprobs.numel()))
        generated = self.num_generated + 1
        live: list[Candidate] = []
        new_finished: list[BeamHypothesis] = []
        all_stop = True
        for rank, (score, index) in enumerate(zip(scores.tolist(), flat.tolist())):
            parent, token_id = divmod(index, vocab)
            stops = token_id in self.eos_token_ids or generated >= self.max_tokens
            all_stop &= stops
            if not stops:
                live.append(Candidate(parent, token_id, score))
            elif rank < k and self._accepts_finished():
                tokens = self.beams[parent].completion_token_ids + [token_id]
                new_finished.append(BeamHypothesis(
                    tokens, score / generated ** self.length_penalty, score))
        # Earlier hypotheses first among equal scores, as transformers' merge does.
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[:k]
        self.num_generated = generated
        live = live[:k]
        self._update_improvable(live)
        self.done = (all_stop or not self.improvable
                     or (self.early_stopping is True and len(self.finished) == k))
        return [] if self.done else live

    def _accepts_finished(self) -> bool:
        full = len(self.finished) == self.beam_width and self.early_stopping is True
        return self.improvable and not full

    def _update_improvable(self, live: list[Candidate]) -> None:
        if not live or len(self.finished) < self.beam_width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens
        else:
            length = self.num_generated
        best_possible = live[0].cum_logprob / length ** self.length_penalty
        if not best_possible > self.finished[-1].score:
            self.improvable = False
