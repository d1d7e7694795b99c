"""Draft-model proposer: a second, cheaper model guesses the next k tokens greedily.

Two kinds of draft:
- a separate model sharing the target's tokenizer (speculative_config {"model": path});
- self-speculation ({"method": "self", "num_draft_layers": N}): the target's own first N
  layers, then its final norm and LM head (an early exit). The draft is a view of the
  target: its modules are the target's (same tensors, no copy) except each attention layer,
  copied so that it can point at the draft's own KV cache.

Either runs through a ModelRunner of its own (the model classes, the attention backends,
the executors, under its own Context) over its own paged KV pool: a free list of blocks of
block_size tokens and one block list per sequence. Per sequence the proposer tracks how
many of the sequence's tokens the draft cache holds. Each step, for all rows at once, it
catches the draft up on the tokens it has not seen (the whole prompt the first time, later
the accepted drafts and the target's token) as chunked-prefill rows of one forward pass,
takes the argmax at each row's last token, then runs k - 1 one-token decode steps for the
rows still proposing. The drafts' own KV is kept: next step, the positions whose tokens the
target accepted are already computed, and the rest are overwritten (the computed count is
set back to the accepted tokens).

The draft is greedy, a point mass on its tokens, so the target's rejection sampler keeps
the target's distribution exactly (spec_decode/rejection_sampler.py). Drafts never preempt:
a row whose draft blocks are short proposes fewer tokens, or none.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.context import get_context, reset_context
from pagedllm.config import EngineConfig
from pagedllm.engine.kv_cache import KVCacheShape
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.spec_decode.proposer import Proposer
from pagedllm.kernels.probes import gguf_linear_available
from pagedllm.layers.attention import Attention
from pagedllm.layers.gguf_packing import SUPPORTED_TYPES
from pagedllm.loader import ModelSource, load_model_source
from pagedllm.models.config import ModelConfig
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)


# ---- building the draft -------------------------------------------------------------------


def build_draft_proposer(config: EngineConfig, target: ModelRunner,
                         source: ModelSource) -> DraftModelProposer:
    """The proposer speculative_config (method draft_model or self) asks for, beside the
    target's runner (resolved config) and model source."""
    spec = config.speculative_config
    assert isinstance(spec, dict)
    if config.tensor_parallel_size != 1:
        raise ValueError(f"speculative_config: method {spec['method']!r} runs on one rank "
                         "(tensor_parallel_size=1)")
    if spec["method"] == "self":
        runner = _self_draft_runner(config, target, spec["num_draft_layers"],
                                    spec["num_draft_blocks"])
    else:
        runner = _separate_draft_runner(config, target, source, spec["model"],
                                        spec["num_draft_blocks"])
    assert config.max_num_batched_tokens is not None
    return DraftModelProposer(runner, spec["num_speculative_tokens"],
                              config.max_num_batched_tokens)


def _draft_config(config: EngineConfig, draft_mc: ModelConfig, target: ModelRunner,
                  num_blocks: int | None, **changes: object) -> EngineConfig:
    """The draft runner's options: the target's, with a KV budget of num_blocks draft blocks
    (default: as many blocks as the target's pool), no swap space, no speculation."""
    assert config.max_model_len is not None
    max_model_len = min(config.max_model_len, draft_mc.max_position_embeddings)
    shape = KVCacheShape.of(config, draft_mc)
    blocks = num_blocks if num_blocks is not None else target.num_kvcache_blocks
    return dataclasses.replace(config, kv_cache_memory_bytes=blocks * shape.block_bytes,
                               max_model_len=max_model_len, preemption_mode="recompute",
                               speculative_config=None, check_invariants=False, **changes)


def _self_draft_runner(config: EngineConfig, target: ModelRunner, num_layers: int,
                       num_blocks: int | None) -> ModelRunner:
    mc = target.model_config
    if not 1 <= num_layers < mc.num_hidden_layers:
        raise ValueError(f"speculative_config: num_draft_layers must be in [1, "
                         f"{mc.num_hidden_layers - 1}] (the target has {mc.num_hidden_layers} "
                         f"layers), got {num_layers}")
    draft_mc = dataclasses.replace(
        mc, num_hidden_layers=num_layers,
        layer_types=None if mc.layer_types is None else mc.layer_types[:num_layers])
    model = early_exit_view(target.model, num_layers)
    runner = _ViewRunner(_draft_config(config, draft_mc, target, num_blocks), draft_mc, model,
                         target.attention_backend)
    logger.info("self-speculation: the target's first %d of %d layers draft; draft KV pool "
                "%d blocks", num_layers, mc.num_hidden_layers, runner.num_kvcache_blocks)
    return runner


def _separate_draft_runner(config: EngineConfig, target: ModelRunner, source: ModelSource,
                           path: str, num_blocks: int | None) -> ModelRunner:
    draft = load_model_source(path)
    check_same_vocabulary(source, draft)
    keep = frozenset()
    if config.quantization == "gguf" and draft.format == "gguf" and gguf_linear_available():
        keep = frozenset(SUPPORTED_TYPES) & draft.tensor_types
    draft_config = _draft_config(config, draft.config, target, num_blocks, model=path,
                                 quantization="gguf" if keep else "none")
    runner = ModelRunner(draft_config, draft.config, draft.weights(config.torch_dtype, keep))
    logger.info("draft model %s: %d layers; draft KV pool %d blocks", path,
                draft.config.num_hidden_layers, runner.num_kvcache_blocks)
    return runner


def check_same_vocabulary(target: ModelSource, draft: ModelSource) -> None:
    """A draft proposes token ids the target verifies: both must mean the same token by
    the same id, and score the same number of ids."""
    sizes = (target.config.vocab_size, draft.config.vocab_size)
    target_vocab = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if sizes[0] == sizes[1] and target_vocab == draft_vocab:
        return
    detail = f"{sizes[1]} token ids against the target's {sizes[0]}"
    if sizes[0] == sizes[1]:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda x: x[1])
        detail = f"{len(differ)} (token, id) pairs differ, e.g. {differ[0]!r}"
    raise ValueError(f"speculative_config: the draft model {draft.path!r} has a different "
                     f"vocabulary from the target {target.path!r} ({detail}); a draft model "
                     "must share the target's tokenizer")


def early_exit_view(model: nn.Module, num_layers: int) -> nn.Module:
    """The model cut after its first num_layers decoder layers (then its final norm and LM
    head): the same parameter tensors, packings and kernels, but its own attention modules,
    which a ModelRunner binds to its own KV cache. Works for every family whose decoder keeps
    its layers in model.model.layers (all of models/)."""
    view = _shallow_copy(model)
    decoder = _shallow_copy(model.model)
    decoder.layers = nn.ModuleList(_with_own_attention(layer)
                                   for layer in model.model.layers[:num_layers])
    view.model = decoder
    return view


def _with_own_attention(module: nn.Module) -> nn.Module:
    """A shallow copy of module in which every Attention below it is a copy too."""
    if isinstance(module, Attention):
        return _shallow_copy(module)
    if not any(isinstance(m, Attention) for m in module.modules()):
        return module
    out = _shallow_copy(module)
    for name, child in module.named_children():
        setattr(out, name, _with_own_attention(child))
    return out


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object over the same parameters and submodules; setting a submodule or
    an attribute (a KV cache) on it leaves the original alone. Hooks are not carried over:
    a hook put on a target layer (fault injection) fires for the target's calls only."""
    out = copy.copy(module)
    out.__dict__["_modules"] = dict(module._modules)
    for name, value in module.__dict__.items():
        if name.endswith("hooks") and isinstance(value, dict):
            out.__dict__[name] = type(value)()
    return out


class _ViewRunner(ModelRunner):
    """A ModelRunner over a model already built (the target's early-exit view): it loads
    nothing; the attention modules keep the backend the target bound."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: nn.Module,
                 attention_backend: str) -> None:
        self._view, self._view_backend = model, attention_backend
        super().__init__(config, model_config, ())

    def _load_model(self, weights: object) -> None:
        self.model, self.attention_backend = self._view, self._view_backend


# ---- proposing ----------------------------------------------------------------------------


@dataclass
class _DraftState:
    """One sequence's share of the draft cache."""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0   # the sequence's first tokens whose KV the draft holds
    drafts: list[int] = field(default_factory=list)  # the last proposal (KV of all but its last)


@dataclass
class _DraftRow:
    """What ModelRunner.prepare_inputs reads of a row: the sequence's tokens (then the
    drafts so far), how many the draft cache holds, the draft's block table."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    num_drafts: int                # to propose (0: a catch-up chunk that does not finish)
    spec_token_ids: tuple[int, ...] = ()


@dataclass
class DraftStats:
    """Lifetime counters: propose() calls, the draft's forward passes and tokens, seconds."""

    num_calls: int = 0
    num_forwards: int = 0
    num_tokens: int = 0
    seconds: float = 0.0


class DraftModelProposer(Proposer):
    """Greedy drafts from runner's model over runner's KV pool, whose blocks it hands out
    itself (free_blocks, one _DraftState per sequence id)."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int,
                 max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = runner.block_size
        self.num_blocks = runner.num_kvcache_blocks
        self.max_model_len = runner.config.max_model_len
        self.max_catch_up_tokens = max_num_batched_tokens   # per step, as the target's budget
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.states: dict[int, _DraftState] = {}
        self.stats = DraftStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def propose(self, seqs: list[Sequence], max_lens: list[int]) -> list[list[int]]:
        t = time.perf_counter()
        rows, budget = [], self.max_catch_up_tokens
        for seq, max_len in zip(seqs, max_lens):
            row = self._row(seq, min(self.num_speculative_tokens, max_len), budget)
            if row is not None:
                rows.append(row)
                budget -= len(row.token_ids) - row.num_computed_tokens
        drafts = self._run(rows) if rows else {}
        self.stats.num_calls += 1
        self.stats.seconds += time.perf_counter() - t
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.block_table))

    # ---- one step ----------------------------------------------------------------------

    def _row(self, seq: Sequence, k: int, budget: int) -> _DraftRow | None:
        """seq's row of this step's draft passes, its catch-up cut to budget tokens; None
        where it has no room (budget, the draft's max_model_len, its blocks)."""
        state = self._sync(seq)
        start, size = state.num_computed_tokens, len(seq)
        k = min(k, self.max_model_len - size + 1)   # the last draft's position: size + k - 2
        if budget <= 0 or k < 1:
            return None
        if size - start > budget:                    # a catch-up chunk only: no drafts yet
            k, end = 0, min(start + budget, size)
        else:
            end = size
        k = self._grow(state, end, k)
        if k < 0:
            return None
        return _DraftRow(seq.seq_id, seq.token_ids[:end], start, state.block_table, k)

    def _sync(self, seq: Sequence) -> _DraftState:
        """seq's draft state, its computed count set back to the tokens the draft saw: the
        drafts whose KV it computed last step hold until the first one the sequence did not
        take (the last token always runs again: its logits give the first draft)."""
        state = self.states.setdefault(seq.seq_id, _DraftState())
        start, tokens = state.num_computed_tokens, seq.token_ids
        limit = min(len(state.drafts) - 1, len(tokens) - 1 - start)
        matched = 0
        while matched < limit and tokens[start + matched] == state.drafts[matched]:
            matched += 1
        state.num_computed_tokens = start + matched
        state.drafts = []
        return state

    def _grow(self, state: _DraftState, end: int, k: int) -> int:
        """Give state blocks for the tokens up to end and k - 1 drafts after them, fewer
        drafts where blocks are short; the drafts it can take, -1 where not even the
        tokens fit (then it takes no block)."""
        need = cdiv(end + max(k - 1, 0), self.block_size) - len(state.block_table)
        if need > len(self.free_blocks):
            have = (len(state.block_table) + len(self.free_blocks)) * self.block_size
            if have < end:
                return -1
            k = min(k, have - end + 1)
            need = cdiv(end + max(k - 1, 0), self.block_size) - len(state.block_table)
        for _ in range(need):
            state.block_table.append(self.free_blocks.pop())
        return k

    @torch.inference_mode()
    def _run(self, rows: list[_DraftRow]) -> dict[int, list[int]]:
        """The catch-up pass, then k - 1 decode passes; the drafts by seq_id."""
        rows.sort(key=lambda r: len(r.token_ids) - r.num_computed_tokens != 1)  # decodes first
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in rows if r.num_drafts}
        next_ids = self._forward(rows, [len(r.token_ids) - r.num_computed_tokens for r in rows])
        for row, token in zip(rows, next_ids):
            state = self.states[row.seq_id]
            state.num_computed_tokens = len(row.token_ids)
            if row.num_drafts:
                drafts[row.seq_id].append(token)
        active = [r for r in rows if r.num_drafts > 1]
        for j in range(1, max((r.num_drafts for r in rows), default=0)):
            active = [r for r in active if r.num_drafts > j]
            for row in active:
                row.token_ids.append(drafts[row.seq_id][-1])
                row.num_computed_tokens = len(row.token_ids) - 1
            for row, token in zip(active, self._forward(active, [1] * len(active))):
                drafts[row.seq_id].append(token)
        for seq_id, tokens in drafts.items():
            self.states[seq_id].drafts = tokens
        return drafts

    def _forward(self, rows: list[_DraftRow], num_new_tokens: list[int]) -> list[int]:
        """One draft forward pass over rows; the argmax after each row's last token."""
        runner = self.runner
        input_ids, positions = runner.prepare_inputs(rows, num_new_tokens)  # type: ignore[arg-type]
        try:
            logit_rows = get_context().cu_seqlens_q[1:] - 1
            logits, _ = runner.execute_model(input_ids, positions, logit_rows)
        finally:
            reset_context()
        assert logits is not None
        self.stats.num_forwards += 1
        self.stats.num_tokens += int(input_ids.numel())
        return logits.argmax(-1).tolist()
