"""Speculative decoding without a model: the n-gram proposer, the rejection sampler's
acceptance rule (greedy and a distribution-preservation test), speculative_config
validation, the scheduler + block manager under random propose / accept / reject /
preempt sequences, and the /metrics counters."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedllm.config import DEFAULT_DISABLE_BY_BATCH_SIZE, EngineConfig, parse_speculative_config
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.spec_decode.control import SpeculationControl
from pagedllm.engine.spec_decode.ngram import NgramProposer, propose_ngram
from pagedllm.engine.spec_decode.rejection_sampler import verify_greedy, verify_sampled
from pagedllm.engine.stats import EngineStats
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.sampling_params import SamplingParams

# ---- n-gram proposer --------------------------------------------------------------------


def test_ngram_copies_what_followed_the_most_recent_earlier_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # last 3 tokens [1, 2, 3] occur at 0 and 4; the latest (4) is followed by 7, 8, 5
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 5]
    assert propose_ngram(tokens, 5, 1, 3) == [7, 8, 5, 1, 2]


def test_ngram_prefers_the_longest_match():
    # n = 2: [4, 2] occurs at 1, followed by 6; n = 1 alone: the latest [2] is at 6, then 4
    tokens = [0, 4, 2, 6, 9, 2, 2, 4, 2]
    assert propose_ngram(tokens, 1, 1, 2) == [6]
    assert propose_ngram(tokens, 1, 1, 1) == [4]   # the latest earlier [2] is at 6, then 4


def test_ngram_stops_at_the_end_of_the_sequence_and_allows_overlap():
    assert propose_ngram([5, 5, 5], 4, 1, 2) == [5]          # [5, 5] at 0, followed by one 5
    assert propose_ngram([1, 2, 3, 1], 4, 1, 3) == [2, 3, 1]


def test_ngram_proposes_nothing_without_a_match_or_below_min():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 9, 1, 2], 3, 3, 3) == []     # only a 2-gram repeats
    assert propose_ngram([7], 3, 1, 3) == []
    assert propose_ngram([1, 1, 1], 0, 1, 3) == []
    seq = Sequence([1, 2, 1, 2, 1], SamplingParams(), block_size=4)
    assert NgramProposer(4, 1, 3).propose([seq], [2]) == [[2, 1]]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 2))
@settings(max_examples=300, deadline=None)
def test_ngram_proposal_is_a_continuation_of_an_earlier_occurrence(tokens, k, lo, extra):
    hi = lo + extra
    out = propose_ngram(tokens, k, lo, hi)
    assert len(out) <= k
    if not out:
        return
    size = len(tokens)
    matches = [(n, i) for n in range(hi, lo - 1, -1) for i in range(size - n - 1, -1, -1)
               if n < size and tokens[i:i + n] == tokens[size - n:]]
    n, i = matches[0]   # the longest n, then the latest start
    assert out == tokens[i + n:i + n + k]


# ---- rejection sampler ------------------------------------------------------------------


def test_greedy_verification_accepts_the_matching_prefix_then_the_targets_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]   # all accepted + bonus
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]         # rejected at 1
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([3], []) == [3]


def test_sampled_verification_preserves_the_target_distribution():
    """Each emitted position is distributed as the target (chi-square over 20k draws),
    whatever the draft: a likely draft token, an unlikely one, one with p = 0."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    probs = torch.stack([p0, p1])
    draws = 20000
    for draft in (0, 3, 1):
        counts = torch.zeros(4)
        second = torch.zeros(4)
        for _ in range(draws):
            out = verify_sampled(probs, [draft], g)
            counts[out[0]] += 1
            if len(out) == 2:
                second[out[1]] += 1
        expected = p0 * draws
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 16.3, (draft, counts, chi2)   # 3 degrees of freedom, p = 0.001
        n2 = second.sum()
        chi2 = float(((second - p1 * n2) ** 2 / (p1 * n2)).sum())
        assert chi2 < 16.3, (draft, second, chi2)
        # accepted exactly as often as the target draws the draft: p(x)
        assert abs(n2 / draws - float(p0[draft])) < 0.015
    zero = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    assert all(verify_sampled(zero, [3], g)[0] in (1, 2) for _ in range(200))


def test_sampled_verification_is_reproducible_with_a_seeded_generator():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1)
    runs = [[verify_sampled(probs, [1, 2, 3], torch.Generator().manual_seed(7))
             for _ in range(1)] for _ in range(2)]
    assert runs[0] == runs[1]


# ---- speculative_config -----------------------------------------------------------------


def test_speculative_config_parses_json_and_fills_defaults():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 4, "adaptive": True,
                   "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
    assert parse_speculative_config({"method": "suffix"}) == {
        "method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1, "adaptive": True,
        "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
    cfg = parse_speculative_config('{"method": "suffix", "num_speculative_tokens": 6, '
                                   '"adaptive": false, "disable_by_batch_size": null}')
    assert (cfg["num_speculative_tokens"], cfg["adaptive"], cfg["disable_by_batch_size"]) == (
        6, False, None)
    assert EngineConfig(speculative_config=None).speculative_config is None
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 2}).speculative_config[
        "prompt_lookup_max"] == 2


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "exceeds prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
     "unknown keys"),
    ({"method": "suffix", "prompt_lookup_max": 3}, "unknown keys"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "must be >= 2"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "integer >= 0"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "number > 0"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, r"in \[0, 1\]"),
    ({"method": "suffix", "adaptive": "yes"}, "adaptive must be true or false"),
    ({"method": "suffix", "disable_by_batch_size": 0}, "disable_by_batch_size must be a positive"),
])
def test_speculative_config_rejects_bad_values_clearly(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


# ---- scheduler and block manager under speculation --------------------------------------

BS = 4
EOS = 0


def run_random_steps(seed: int, num_blocks: int, k: int, prompts: list[list[int]],
                     prefix_caching: bool) -> Scheduler:
    """Drive a scheduler with an n-gram proposer: every step the 'model' accepts a random
    prefix of each row's drafts and emits a random next token; random aborts. Invariants
    are checked after every schedule and every postprocess."""
    rng = random.Random(seed)
    swap = rng.random() < 0.3
    s = Scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=6, max_num_batched_tokens=12,
                  max_model_len=48, eos_token_ids=[EOS], enable_prefix_caching=prefix_caching,
                  preemption_mode="swap" if swap else "recompute", num_swap_blocks=8 if swap else 0,
                  proposer=NgramProposer(k, 1, 2))
    seqs = []
    for p in prompts:
        # (each fits in the cache alone, as the engine's request validation ensures)
        params = SamplingParams(max_tokens=rng.randint(1, min(24, num_blocks * BS - len(p))),
                                ignore_eos=True)
        seq = Sequence(p, params, BS)
        if rng.random() < 0.3:  # n = 2: a fork sharing the prompt's blocks (copy on write)
            seq.pending_forks = [Sequence(p, params, BS)]
        s.add(seq)
        seqs += [seq, *seq.pending_forks]
    for _ in range(400):
        if s.is_finished():
            break
        batch = s.schedule()
        s.check_invariants()
        accepted = []
        for seq, _ in batch.samplers:
            drafts = seq.spec_token_ids
            j = rng.randint(0, len(drafts))
            accepted.append(drafts[:j])
        tokens = [rng.randint(1, 3) for _ in batch.samplers]
        s.postprocess(batch, tokens, accepted)
        assert all(not seq.spec_token_ids for seq in seqs)
        s.check_invariants()
        if rng.random() < 0.05 and s.running:
            s.finish(rng.choice(list(s.running)), "abort")
            s.check_invariants()
    assert s.is_finished()
    return s


@given(st.integers(0, 10**6), st.integers(6, 24), st.integers(1, 5),
       st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=20), min_size=1, max_size=5),
       st.booleans())
@settings(max_examples=150, deadline=None)
def test_random_speculation_keeps_block_invariants_and_frees_every_block(
        seed, num_blocks, k, prompts, prefix_caching):
    s = run_random_steps(seed, num_blocks, k, prompts, prefix_caching)
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_random_speculation_proposes_accepts_and_preempts():
    """The property test's setting does exercise drafts, acceptance and preemption."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [2, 2, 2, 2, 2], [3, 1, 3, 1, 3, 1, 3]]
    s = run_random_steps(3, 6, 4, prompts, True)
    assert s.num_draft_tokens > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert s.num_preemptions > 0


def test_rejected_drafts_blocks_are_freed_and_accepted_blocks_cached():
    s = Scheduler(num_blocks=8, block_size=BS, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64, eos_token_ids=[EOS], proposer=NgramProposer(5, 1, 3))
    seq = Sequence([5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=20), BS)
    s.add(seq)
    batch = s.schedule()                      # the prompt
    s.postprocess(batch, [7])                 # tokens [5 6 7 8 | 9 5 6 7]
    batch = s.schedule()                      # drafts: after [5, 6, 7] came 8, 9, 5, 6, 7
    assert seq.spec_token_ids == [8, 9, 5, 6, 7] and batch.num_new_tokens == [6]
    assert len(seq.block_table) == 4          # slots 7..12 (4 blocks of 4)
    s.postprocess(batch, [4], [[8, 9]])       # accept 8, 9; the target says 4
    assert seq.token_ids[8:] == [8, 9, 4] and seq.num_computed_tokens == 10
    assert len(seq.block_table) == 3          # block 3 held only rejected drafts
    bm = s.block_manager
    assert bm.blocks[seq.block_table[1]].hash != -1   # [9 5 6 7] is full and accepted
    assert bm.blocks[seq.block_table[2]].hash == -1   # [8 9 4 .] is not full
    s.check_invariants()
    assert bm.num_free_blocks == 5


def test_metrics_endpoint_reports_draft_and_accepted_tokens():
    stats = EngineStats(num_running=0, num_waiting=0, num_blocks=8, num_used_blocks=0,
                        num_free_blocks=8, num_cached_free_blocks=0, prefix_cache_hit_rate=0.0,
                        num_preemptions=0, num_drafts=4, num_draft_tokens=12,
                        num_accepted_tokens=7)
    text = ServerMetrics().render(stats).decode()
    assert "pagedllm_spec_decode_num_drafts 4.0" in text
    assert "pagedllm_spec_decode_num_draft_tokens 12.0" in text
    assert "pagedllm_spec_decode_num_accepted_tokens 7.0" in text


def one_verified_step(params: SamplingParams, stop: int, accept: int) -> tuple[Scheduler, Sequence]:
    """Prompt [5 6 7 8 stop 5 6], first token 7, then drafts [8 stop 5 6 7] (as many as
    max_tokens leaves) of which `accept` are accepted; the target's token is 4."""
    s = Scheduler(num_blocks=8, block_size=BS, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64, eos_token_ids=[EOS], proposer=NgramProposer(5, 1, 3))
    seq = Sequence([5, 6, 7, 8, stop, 5, 6], params, BS)
    s.add(seq)
    s.postprocess(s.schedule(), [7])
    batch = s.schedule()
    assert seq.spec_token_ids == [8, stop, 5, 6, 7][:len(seq.spec_token_ids)]
    s.postprocess(batch, [4], [seq.spec_token_ids[:accept]])
    return s, seq


@pytest.mark.parametrize("params, stop, reason", [
    (SamplingParams(max_tokens=20, stop_token_ids=[9]), 9, ("stop", 9)),
    (SamplingParams(max_tokens=20), EOS, ("stop", None)),
], ids=["stop-token", "eos"])
def test_a_stop_inside_accepted_drafts_drops_the_rest(params, stop, reason):
    s, seq = one_verified_step(params, stop, accept=4)
    assert seq.completion_token_ids == [7, 8, stop]
    assert (seq.finish_reason, seq.stop_reason) == reason
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 5, 4)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_drafts_never_run_past_max_tokens():
    s, seq = one_verified_step(SamplingParams(max_tokens=3), 9, accept=1)
    assert s.num_draft_tokens == 1     # 1 token so far; 1 draft + the target's = 3
    assert seq.completion_token_ids == [7, 8, 4] and seq.finish_reason == "length"


# ---- adaptive proposal length and stand-down --------------------------------------------


class FixedProposer(NgramProposer):
    """Proposes max_lens[i] copies of token 1 for every row (records what it was asked)."""

    def propose(self, seqs, max_lens):
        self.asked = list(max_lens)
        return [[1] * k for k in max_lens]


def speculating_scheduler(control: SpeculationControl, k: int = 4,
                          num_seqs: int = 1) -> tuple[Scheduler, list[Sequence], FixedProposer]:
    proposer = FixedProposer(k, 1, 1)
    s = Scheduler(num_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=256, eos_token_ids=[EOS], proposer=proposer,
                  spec_control=control)
    seqs = [Sequence([5, 6, 7], SamplingParams(max_tokens=100), BS) for _ in range(num_seqs)]
    for seq in seqs:
        s.add(seq)
    s.postprocess(s.schedule(), [7] * num_seqs)   # the prompts
    return s, seqs, proposer


def test_adaptive_proposals_shrink_on_rejection_to_one_and_grow_back_on_acceptance():
    s, (seq,), proposer = speculating_scheduler(SpeculationControl(adaptive=True))
    lens = []
    for accept_all in [False] * 6 + [True] * 4:
        batch = s.schedule()
        lens.append(len(seq.spec_token_ids))
        s.postprocess(batch, [9], [seq.spec_token_ids if accept_all else []])
        s.check_invariants()
    # average 1, .5, .25, ... 1/64 (rejections), then halfway to 1 each step: ceil(4 * it)
    assert lens == [4, 2, 1, 1, 1, 1, 1, 3, 4, 4]
    assert seq.spec_acceptance == pytest.approx(1 - (1 - 1 / 64) / 16)


def test_without_adaptivity_every_proposal_has_num_speculative_tokens():
    s, (seq,), _ = speculating_scheduler(SpeculationControl(adaptive=False))
    for _ in range(4):
        batch = s.schedule()
        assert len(seq.spec_token_ids) == 4
        s.postprocess(batch, [9], [[]])


@pytest.mark.parametrize("threshold, num_seqs, drafts", [
    (None, 6, True), (7, 6, True), (6, 6, False), (1, 1, False)])
def test_no_drafts_in_steps_with_disable_by_batch_size_decode_rows(threshold, num_seqs, drafts):
    control = SpeculationControl(adaptive=False, disable_by_batch_size=threshold)
    s, seqs, _ = speculating_scheduler(control, num_seqs=num_seqs)
    batch = s.schedule()
    assert all(bool(seq.spec_token_ids) == drafts for seq in seqs)
    assert batch.num_tokens == num_seqs * (5 if drafts else 1)
