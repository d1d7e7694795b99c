"""The sampler: token controls (structured-output masks, allowed tokens, logit bias, banned
tokens), penalties, then greedy, or temperature / top-k / top-p / min-p then Gumbel-max
(seed 002); optionally the logprobs of what was sampled.

Gumbel-max: argmax(p_i / E_i) with E_i ~ Exponential(1) draws i with probability p_i.
A request with a seed draws its noise from its own generator, so its samples do not
depend on what else is in the batch.

Everything runs where the logits are (the model's device; on CUDA only the sampled token ids
and the logprobs asked for go back to the host); the batch's tensors and generators must be
on that device too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.kernels import ops, probes
from pagedllm.outputs import TokenLogprobs


@dataclass
class Penalties:
    """Per-row penalty inputs with vLLM's semantics; built only when a row uses a penalty.

    Repetition penalty looks at prompt and output tokens; presence and frequency penalties
    look at output tokens only.
    """

    repetition: torch.Tensor       # [B] float32, 1 = off
    frequency: torch.Tensor        # [B] float32, 0 = off
    presence: torch.Tensor         # [B] float32, 0 = off
    output_counts: torch.Tensor    # [B, V] float32: times each token was generated so far
    prompt_mask: torch.Tensor      # [B, V] bool: token occurs in the prompt


@dataclass
class SamplingBatch:
    """Per-row sampling options of one step, prepared by the ModelRunner."""

    temperatures: torch.Tensor            # [B] float32; 0 = greedy
    top_ks: torch.Tensor | None           # [B] int64, vocab size = disabled
    top_ps: torch.Tensor | None           # [B] float32, 1 = disabled
    min_ps: torch.Tensor | None           # [B] float32, 0 = disabled
    generators: list[torch.Generator | None]
    all_greedy: bool
    # (row, token ids) whose logits are forced to -inf: EOS before min_tokens, bad words
    banned: list[tuple[int, list[int]]]
    penalties: Penalties | None = None
    # Per row: how many top logprobs to return (0 = only the sampled token's), None = none.
    # The whole list is None when no row asks, so the common step does no logprob work.
    num_logprobs: list[int | None] | None = None
    # (row, token ids): the only tokens the row may sample (allowed_token_ids)
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)
    # (row, token ids, biases) added to the logits (logit_bias)
    bias: list[tuple[int, list[int], list[float]]] = field(default_factory=list)
    # rows under a grammar, and their token masks [len(grammar_rows), ceil(V / 32)] int32
    # (bit t % 32 of word t // 32 set: token t is allowed; layers/structured_output.py)
    grammar_rows: list[int] = field(default_factory=list)
    grammar_masks: torch.Tensor | None = None

    @property
    def changes_logits(self) -> bool:
        """Whether any row's logits change before sampling (controls or penalties)."""
        return bool(self.penalties is not None or self.banned or self.allowed or self.bias
                    or self.grammar_rows)


@dataclass
class SamplerOutput:
    """What one step sampled: a token per row and, if any row asked, its logprobs; with
    speculative decoding, per row the accepted draft tokens that come before its token."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    accepted: list[list[int]] | None = None
    # with logprobs asked: per row, those of the accepted drafts (logprobs: its last token's)
    accepted_logprobs: list[list[TokenLogprobs | None]] | None = None


def unpack_token_masks(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [R, vocab_size] of int32 bit masks [R, W] (bit t % 32 of word t // 32: token t;
    little-endian words, so bit t of the bytes in order)."""
    bits = np.unpackbits(masks.cpu().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab_size])).view(torch.bool)


def apply_token_controls(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
                         ) -> torch.Tensor:
    """fp32 logits after the batch's token controls and penalties: grammar masks and allowed
    tokens (everything else -inf), logit bias, penalties, banned tokens (-inf); as vLLM
    orders them. logits [len(rows), V] are batch rows `rows` (a copy is made)."""
    x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    position = {row: i for i, row in enumerate(rows)}
    if batch.grammar_masks is not None:
        here = [(i, position[row]) for i, row in enumerate(batch.grammar_rows) if row in position]
        if here:
            masks, at = zip(*here)
            chosen = batch.grammar_masks[list(masks)]
            if x.is_cpu and x.stride(-1) == 1 and probes.available():  # in C++, in place
                ops.apply_token_bitmask_(x, chosen.contiguous(), torch.tensor(at))
            else:
                allowed = unpack_token_masks(chosen, x.shape[-1]).to(x.device, non_blocking=True)
                if list(at) == list(range(x.shape[0])):  # every row (one row alone, say)
                    x = torch.where(allowed, x, float("-inf"))
                else:
                    x[list(at)] = x[list(at)].masked_fill(~allowed, float("-inf"))
    for row, token_ids in batch.allowed:
        if row in position:
            i = position[row]
            kept = x[i, token_ids]
            x[i] = float("-inf")
            x[i, token_ids] = kept
    for row, token_ids, biases in batch.bias:
        if row in position:
            x[position[row], token_ids] += torch.tensor(biases, device=x.device)
    if batch.penalties is not None:
        x = apply_penalties(x, _take_rows(batch.penalties, torch.tensor(rows, device=x.device)))
    for row, token_ids in batch.banned:
        if row in position:
            x[position[row], token_ids] = float("-inf")
    return x


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition penalty (divide positive logits, multiply negative ones, for every token
    seen in prompt or output), then frequency (x count) and presence (x seen) penalties
    subtracted for tokens generated so far."""
    generated = p.output_counts > 0
    rep = p.repetition[:, None].expand_as(logits)
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(p.prompt_mask | generated, repeated, logits)
    return (logits - p.frequency[:, None] * p.output_counts
            - p.presence[:, None] * generated.to(logits.dtype))


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                            top_ps: torch.Tensor | None, min_ps: torch.Tensor | None
                            ) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's filters exclude. logits [B, V] already tempered."""
    if min_ps is not None:
        probs = logits.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * min_ps[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if top_ks is not None:
        kth = sorted_logits.gather(-1, (top_ks - 1).clamp(0, logits.shape[-1] - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p. The top token is always kept.
        mass_before = probs.cumsum(-1) - probs
        drop = mass_before >= top_ps[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                       default: torch.Generator) -> torch.Tensor:
    """Exponential(1) noise on the generators' device (the default's for unseeded rows)."""
    noise = torch.empty(shape, device=default.device)
    if all(g is None for g in generators):
        return noise.exponential_(generator=default)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen if gen is not None else default)
    return noise


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index (torch.argmax's answer, faster on CPU)."""
    if logits.is_cpu and logits.stride(-1) == 1 and probes.available():
        return ops.argmax_rows(logits)
    return logits.argmax(-1)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """Token ids [B] drawn from logits [B, V]."""
    if batch.all_greedy and not batch.changes_logits:
        # The argmax of the logits as they are: widening bf16 to fp32 keeps their order,
        # and skipping it saves 2.3 ms of a 64-row decode step.
        return _argmax(logits)
    if batch.changes_logits:
        logits = apply_token_controls(logits, batch, list(range(logits.shape[0])))
    else:
        logits = logits.float()
    greedy_tokens = _argmax(logits)
    if batch.all_greedy:
        return greedy_tokens
    greedy = batch.temperatures == 0
    temps = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
    logits = apply_top_k_top_p_min_p(logits / temps[:, None], batch.top_ks, batch.top_ps,
                                     batch.min_ps)
    probs = logits.softmax(-1)
    noise = _exponential_noise(tuple(probs.shape), batch.generators, generator)
    sampled = (probs / noise.clamp_min_(1e-10)).argmax(-1)
    return torch.where(greedy, greedy_tokens, sampled)


def _take_rows(p: Penalties, rows: torch.Tensor) -> Penalties:
    return Penalties(p.repetition[rows], p.frequency[rows], p.presence[rows],
                     p.output_counts[rows], p.prompt_mask[rows])


def compute_logprobs(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor
                     ) -> list[TokenLogprobs | None]:
    """Logprobs of the distribution each row was sampled from: the logits after token
    controls, penalties and temperature (greedy rows: temperature 1), before the top-k / top-p /
    min-p cut. Only the rows that asked are computed."""
    assert batch.num_logprobs is not None
    wanted = [row for row, k in enumerate(batch.num_logprobs) if k is not None]
    result: list[TokenLogprobs | None] = [None] * len(batch.num_logprobs)
    if not wanted:
        return result
    rows = torch.tensor(wanted, device=logits.device)
    x = apply_token_controls(logits[rows], batch, wanted)
    temps = batch.temperatures[rows]
    temps = torch.where(temps == 0, torch.ones_like(temps), temps)
    logprobs = (x / temps[:, None]).log_softmax(-1)
    k = max(batch.num_logprobs[row] or 0 for row in wanted)
    top_values, top_ids = logprobs.topk(k, -1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    sampled = token_ids.to(logits.device)[rows]
    chosen = logprobs.gather(-1, sampled[:, None]).squeeze(-1).tolist()
    top_ids, top_values = top_ids.tolist(), top_values.tolist()   # (one copy each)
    for i, (row, token_id) in enumerate(zip(wanted, sampled.tolist())):
        n = batch.num_logprobs[row] or 0
        result[row] = TokenLogprobs(token_id, chosen[i],
                                    list(zip(top_ids[i][:n], top_values[i][:n])))
    return result
