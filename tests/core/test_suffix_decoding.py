"""Suffix decoding without a model: the count trie and its proposals against a brute-force
reference over every substring (hypothesis), incremental per-request updates, the global
cache of finished outputs (learning, LRU eviction) and the proposer's per-step cost."""
from __future__ import annotations

import random
import time
from collections import Counter

from hypothesis import given, settings, strategies as st

from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.spec_decode.suffix import (SuffixNode, SuffixProposer, SuffixTrie,
                                                speculate)
from pagedllm.sampling_params import SamplingParams

tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=40)


def substring_counts(docs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for doc in docs:
        for i in range(len(doc)):
            for n in range(1, depth + 1):
                if i + n <= len(doc):
                    counts[tuple(doc[i:i + n])] += 1
    return counts


def continuations(counts: Counter, path: tuple[int, ...]) -> dict[int, int]:
    return {key[-1]: c for key, c in counts.items() if len(key) == len(path) + 1
            and key[:-1] == path}


def assert_trie_matches(trie: SuffixTrie, counts: Counter) -> None:
    """Every node's count, total and best child against the brute-force counts."""
    seen = 0

    def visit(node: SuffixNode, path: tuple[int, ...]) -> None:
        nonlocal seen
        if path:
            assert node.count == counts[path], path
            seen += 1
        cont = continuations(counts, path) if len(path) < trie.max_depth else {}
        assert node.total == sum(cont.values()), path
        assert set(node.children) == set(cont), path
        if cont:
            assert cont[node.best] == max(cont.values()), path
        for t, child in node.children.items():
            visit(child, path + (t,))

    visit(trie.root, ())
    assert seen == len(counts)


def reference_draft(counts: Counter, context: list[int], depth: int, max_len: int,
                    factor: float, min_prob: float, draft: list[int]) -> None:
    """Check draft step by step: the longest matching suffix, a most frequent continuation
    at each step, and that it stops exactly where the rules say."""
    def total(path: tuple[int, ...]) -> int:
        return sum(continuations(counts, path).values())

    match = 0
    for m in range(min(depth - 1, len(context)), 0, -1):
        if total(tuple(context[-m:])) > 0:
            match = m
            break
    limit = min(max_len, int(factor * match))
    if match == 0 or limit < 1:
        assert draft == []
        return
    virtual, path, prob = list(context), tuple(context[-match:]), 1.0
    for i in range(limit + 1):
        if len(path) == depth:
            path = tuple(virtual[-(depth - 1):])
        cont = continuations(counts, path)
        stop = i == limit or not cont
        if not stop:
            best = max(cont.values())
            stop = prob * best / sum(cont.values()) < min_prob
        if stop:
            assert len(draft) == i, (draft, i)
            return
        t = draft[i] if i < len(draft) else None
        assert t is not None and cont.get(t) == best, (draft, i, cont)
        prob *= cont[t] / sum(cont.values())
        virtual.append(t)
        path = path + (t,)


@given(st.lists(tokens_st, min_size=1, max_size=4), st.integers(2, 6))
@settings(max_examples=150, deadline=None)
def test_trie_counts_every_substring_up_to_its_depth(docs, depth):
    trie = SuffixTrie(depth)
    for doc in docs:
        trie.add(doc)
    assert_trie_matches(trie, substring_counts(docs, depth))


@given(st.lists(tokens_st, min_size=2, max_size=4), st.integers(2, 6), st.data())
@settings(max_examples=100, deadline=None)
def test_removing_a_sequence_restores_the_counts_of_the_rest(docs, depth, data):
    trie = SuffixTrie(depth)
    for doc in docs:
        trie.add(doc)
    gone = data.draw(st.integers(0, len(docs) - 1))
    trie.remove(docs[gone])
    rest = docs[:gone] + docs[gone + 1:]
    assert_trie_matches(trie, substring_counts(rest, depth))


@given(tokens_st, st.integers(2, 6), st.integers(1, 8), st.sampled_from([0.5, 1.0, 2.0, 8.0]),
       st.sampled_from([0.0, 0.1, 0.4, 0.7]))
@settings(max_examples=300, deadline=None)
def test_own_context_proposal_matches_the_reference(tokens, depth, max_len, factor, min_prob):
    trie = SuffixTrie(depth)
    active = trie.start()
    for t in tokens:
        active = trie.extend(active, t)
    draft = speculate(trie, active, tokens, max_len, factor, min_prob)
    reference_draft(substring_counts([tokens], depth), tokens, depth, max_len, factor,
                    min_prob, draft.tokens)


@given(st.lists(tokens_st, min_size=1, max_size=3), tokens_st, st.integers(2, 6),
       st.integers(1, 8), st.sampled_from([1.0, 4.0]), st.sampled_from([0.0, 0.3]))
@settings(max_examples=200, deadline=None)
def test_global_lookup_proposal_matches_the_reference(docs, context, depth, max_len, factor,
                                                     min_prob):
    trie = SuffixTrie(depth)
    for doc in docs:
        trie.add(doc)
    draft = speculate(trie, trie.lookup(context), context, max_len, factor, min_prob)
    reference_draft(substring_counts(docs, depth), context, depth, max_len, factor, min_prob,
                    draft.tokens)


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), block_size=4)


def finish(seq: Sequence, reason: str = "stop") -> None:
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


@given(tokens_st, st.lists(st.integers(0, 3), max_size=30), st.integers(2, 6),
       st.lists(tokens_st, max_size=3))
@settings(max_examples=100, deadline=None)
def test_incremental_updates_equal_a_fresh_build(prompt, appended, depth, finished):
    """Proposals while tokens are appended one or several at a time (accepted drafts), with
    finished outputs joining the global trie in between, equal those of tries built from
    scratch over the same tokens."""
    proposer = SuffixProposer(5, max_tree_depth=depth, min_token_prob=0.0)
    seq = make_seq(prompt)
    rng = random.Random(len(appended))
    i = 0
    while True:
        got = proposer.propose([seq], [5])[0]
        fresh = SuffixProposer(5, max_tree_depth=depth, min_token_prob=0.0)
        for other in proposer._cached.values():
            fresh.global_trie.add(other)
            fresh._cached[len(fresh._cached)] = other
        assert got == fresh.propose([make_seq(seq.token_ids)], [5])[0]
        if i >= len(appended):
            break
        step = rng.randint(1, 3)
        for t in appended[i:i + step]:
            seq.append_token(t)
        i += step
        if finished and rng.random() < 0.3:
            done = make_seq([0])
            for t in finished.pop():
                done.append_token(t)
            finish(done)
            proposer.release(done)


def test_the_global_cache_proposes_an_earlier_output_and_evicts_the_oldest():
    proposer = SuffixProposer(4, max_tree_depth=8, max_cached_requests=2)
    outputs = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]
    for out in outputs:
        seq = make_seq([1, 2])
        for t in out:
            seq.append_token(t)
        finish(seq)
        proposer.release(seq)
    assert proposer.propose([make_seq([5, 30, 31])], [4]) == [[32, 33]]   # factor 1: 2 tokens
    assert proposer.propose([make_seq([5, 20, 21, 22])], [4]) == [[23, 24]]
    assert proposer.propose([make_seq([5, 10, 11])], [4]) == [[]]           # evicted
    assert proposer.global_trie.root.total == 10
    aborted = make_seq([1])
    aborted.append_token(40)
    aborted.append_token(41)
    finish(aborted, "abort")
    proposer.release(aborted)
    assert proposer.propose([make_seq([40])], [4]) == [[]]                   # not learnt


def test_own_context_beats_a_weaker_global_continuation():
    proposer = SuffixProposer(4, max_tree_depth=8)
    for out in ([3, 4, 5, 6], [3, 4, 7, 7]):
        seq = make_seq([1, 2])
        for t in out:
            seq.append_token(t)
        finish(seq)
        proposer.release(seq)
    # own context: 3 4 -> 9 9 (twice, expected 2 tokens); global: 3 4 -> 5 or 7 (1 token)
    live = make_seq([3, 4, 9, 9, 9, 8, 3, 4, 9, 9, 9, 7, 3, 4])
    assert proposer.propose([live], [4]) == [[9, 9]]


def test_draft_continues_past_the_trie_depth():
    pattern = list(range(100, 112))
    seq = make_seq(pattern * 3 + pattern[:5])
    proposer = SuffixProposer(16, max_tree_depth=4, max_spec_factor=8.0)
    assert proposer.propose([seq], [16]) == [(pattern[5:] + pattern)[:16]]


def test_proposal_costs_well_under_a_millisecond_per_row_at_a_few_thousand_tokens():
    rng = random.Random(0)
    prompt = [rng.randrange(500) for _ in range(3000)]
    seqs = [make_seq(prompt) for _ in range(4)]
    proposer = SuffixProposer(8)
    finished = make_seq([1])
    for t in prompt[:400]:
        finished.append_token(t)
    finish(finished)
    proposer.release(finished)
    proposer.propose(seqs, [8] * 4)   # builds the tries (once per request)
    start, steps = time.perf_counter(), 50
    for _ in range(steps):
        for seq in seqs:
            seq.append_token(rng.randrange(500))
        proposer.propose(seqs, [8] * 4)
    per_row = (time.perf_counter() - start) / (steps * len(seqs))
    # ~45 us measured on a loaded 2-core Zen 3 (load average 6); the bound catches a
    # rebuild per step, not a slowdown
    assert per_row < 5e-3, f"{per_row * 1e6:.0f} us per row"
