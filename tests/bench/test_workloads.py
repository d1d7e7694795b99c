"""The bench workloads: deterministic for a seed, shaped as issue 3 specifies."""
from __future__ import annotations

import pytest

from pagedllm.bench import workloads as wl


def test_same_seed_gives_the_same_workload_and_another_seed_does_not():
    for make in (wl.throughput_w1, wl.throughput_nanovllm, wl.latency_w2, wl.prefix_w3):
        a, b, c = make(seed=3), make(seed=3), make(seed=4)
        assert a.requests == b.requests
        assert a.requests != c.requests


def test_w1_lengths_and_token_ids_stay_in_their_ranges():
    w = wl.throughput_w1()
    assert len(w.requests) == 64
    assert all(32 <= r.prompt_len <= 512 and 32 <= r.output_len <= 256 for r in w.requests)
    ids = [t for r in w.requests for t in r.prompt_token_ids]
    assert min(ids) >= 1000 and max(ids) < 40000
    # Uniform draws over 64 requests reach well into both halves of each range.
    assert min(r.prompt_len for r in w.requests) < 150 < 400 < max(r.prompt_len for r in w.requests)


def test_nanovllm_shape_scales_with_num_prompts():
    w = wl.throughput_nanovllm(num_prompts=10)
    assert len(w.requests) == 10
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in w.requests)


def test_w2_is_one_request_of_the_asked_lengths():
    w = wl.latency_w2()
    assert [(r.prompt_len, r.output_len) for r in w.requests] == [(128, 256)]


def test_w3_requests_share_exactly_the_prefix():
    w = wl.prefix_w3()
    prefix = w.requests[0].prompt_token_ids[:1024]
    assert len(w.requests) == 32
    for r in w.requests:
        assert r.prompt_len == 1024 + 32 and r.output_len == 32 and r.shared_prefix_len == 1024
        assert r.prompt_token_ids[:1024] == prefix
    suffixes = {tuple(r.prompt_token_ids[1024:]) for r in w.requests}
    assert len(suffixes) == 32


def test_warmup_never_shares_a_block_with_w3():
    warm = wl.warmup_workload()
    prefix = wl.prefix_w3().requests[0].prompt_token_ids
    blocks = {tuple(prefix[i:i + 16]) for i in range(0, 1024, 16)}
    for r in warm.requests:
        assert tuple(r.prompt_token_ids[:16]) not in blocks


@pytest.mark.parametrize("kwargs, message", [
    ({"num_prompts": 0}, "num_prompts"),
    ({"input_len": (50, 10)}, "input length"),
    ({"output_len": (0, 10)}, "output length"),
])
def test_bad_workload_parameters_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        wl.throughput_w1(**kwargs)


def test_token_ids_stay_inside_a_small_vocabulary_and_large_ones_keep_the_workloads():
    assert wl.token_id_range(49152) == wl.TOKEN_ID_RANGE
    assert wl.token_id_range(32000) == (1000, 32000)
    small = wl.throughput_w1(8, id_range=wl.token_id_range(32000))
    assert max(max(r.prompt_token_ids) for r in small.requests) < 32000
    same = wl.throughput_w1(8, id_range=wl.token_id_range(151936))
    default = wl.throughput_w1(8)
    assert [r.prompt_token_ids for r in same.requests] == [
        r.prompt_token_ids for r in default.requests]
