"""llama.cpp's own speculative decoding in `pagedllm bench spec --compare llamacpp`: its
settings become the server's flags, its responses and counters are read right, its rows
compare with its own "off" and with pagedllm's; and, where scripts/build_llamacpp.sh built a
llama-server, a tiny real run drafts and accepts tokens. No timing is asserted."""
from __future__ import annotations

import argparse
import subprocess

import pytest

from pagedllm.bench import workloads as wl
from pagedllm.bench.llamacpp_runner import default_llama_server, parse_prometheus
from pagedllm.bench.main import add_bench_args, spec_engine_dtype
from pagedllm.bench.report import format_spec_table
from pagedllm.bench.spec import SpecBench, SpecCase, first_difference, peer_row
from pagedllm.bench.spec_llamacpp import (DEFAULT_LLAMA_SPEC, LlamaCompletion,
                                          LlamaMeasurement, LlamaSpecPeer, LlamaSpecSetting,
                                          parse_llama_spec)
from pagedllm.loader import default_model_path, load_model_source

LLAMA_SERVER = default_llama_server()
needs_llama_server = pytest.mark.skipif(
    LLAMA_SERVER is None, reason="no llama-server: $PAGEDLLM_LLAMA_SERVER unset and "
                                 "scripts/build_llamacpp.sh has not built one")


def test_default_settings_are_off_then_ngram_simple_and_ngram_mod():
    assert [s.label for s in parse_llama_spec(DEFAULT_LLAMA_SPEC)] == [
        "off", "ngram-simple:4", "ngram-mod:24"]
    # off always first, once; N defaults per type; repeats dropped
    assert [s.label for s in parse_llama_spec("ngram-mod,off,ngram-simple:12,ngram-mod:24")] == [
        "off", "ngram-mod:24", "ngram-simple:12"]


@pytest.mark.parametrize("bad", ["eagle", "ngram-simple:0", "ngram-simple:x", "draft-simple:3"])
def test_unknown_types_and_bad_lengths_are_rejected(bad):
    with pytest.raises(ValueError, match="llama.cpp speculation"):
        parse_llama_spec(bad)


def test_bench_flag_rejects_a_bad_llama_spec_at_parse_time():
    p = argparse.ArgumentParser(conflict_handler="resolve")   # as the CLI builds it
    add_bench_args(p)
    assert p.parse_args(["spec"]).llama_spec == DEFAULT_LLAMA_SPEC
    with pytest.raises(SystemExit):
        p.parse_args(["spec", "--llama-spec", "ngram-cache"])


def test_server_flags_set_the_lookup_length_and_k_as_the_draft_length():
    assert LlamaSpecSetting("off").server_args(8) == []
    assert LlamaSpecSetting("ngram-simple", 4).server_args(8) == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
        "--spec-ngram-simple-size-m", "8"]
    assert LlamaSpecSetting("ngram-map-k", 3).server_args(5) == [
        "--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
        "--spec-ngram-map-k-size-m", "5"]
    assert LlamaSpecSetting("ngram-mod", 24).server_args(6) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
        "--spec-ngram-mod-n-max", "6", "--spec-ngram-mod-n-min", "1"]
    assert LlamaSpecSetting("ngram-mod", 24).fresh_server_each_run
    assert not LlamaSpecSetting("ngram-simple", 4).fresh_server_each_run


@needs_llama_server
def test_every_flag_we_pass_is_one_the_built_server_knows():
    help_text = subprocess.run([LLAMA_SERVER, "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for setting in parse_llama_spec("ngram-simple,ngram-map-k,ngram-mod"):
        for arg in setting.server_args(8):
            if arg.startswith("--"):
                assert f"{arg} " in help_text or f"{arg}," in help_text, arg
        if setting.spec_type != "off":
            assert setting.spec_type in help_text


def test_a_completion_is_read_from_the_servers_response():
    body = {"tokens": [504, 3575, 2], "tokens_predicted": 3, "stop_type": "eos",
            "timings": {"cache_n": 0, "prompt_n": 40, "predicted_per_second": 12.5,
                        "draft_n": 8, "draft_n_accepted": 6}}
    c = LlamaCompletion.from_response(body)
    assert c.token_ids == [504, 3575, 2] and c.stop_type == "eos"
    assert (c.prompt_n, c.cache_n, c.draft_n, c.draft_n_accepted) == (40, 0, 8, 6)
    assert c.summary()["acceptance_rate"] == 0.75
    # no speculation: the server leaves the draft counts out
    plain = LlamaCompletion.from_response({**body, "timings": {"prompt_n": 40}})
    assert plain.draft_n == 0 and plain.summary()["acceptance_rate"] is None
    with pytest.raises(RuntimeError, match="too old"):
        LlamaCompletion.from_response({"tokens_predicted": 3})
    with pytest.raises(RuntimeError, match="predicted 4"):
        LlamaCompletion.from_response({**body, "tokens_predicted": 4})


def test_prometheus_counters_are_read_without_the_prefix():
    text = ("# HELP llamacpp:spec_decode_num_drafts_total Speculative: steps\n"
            "# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
            "llamacpp:spec_decode_num_drafts_total 17\n"
            "llamacpp:prompt_tokens_seconds 53.5\n"
            'labelled{slot="0"} 3\n')
    assert parse_prometheus(text) == {"spec_decode_num_drafts_total": 17.0,
                                      "prompt_tokens_seconds": 53.5}


def test_first_difference_names_the_request_and_token():
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {
        "request": 1, "token": 1, "lengths": [3, 3]}
    assert first_difference([[1, 2, 3]], [[1, 2]]) == {"request": 0, "token": 2, "lengths": [3, 2]}


def _completion(tokens: list[int], draft_n: int = 0, accepted: int = 0) -> LlamaCompletion:
    return LlamaCompletion(tokens, "eos", 10, 0, draft_n, accepted, None)


def test_a_llama_row_speeds_up_against_its_own_off_and_compares_tokens_with_pagedllm():
    case = SpecCase(wl.Workload("code-edit", "", [wl.BenchRequest([1, 2], 4)] * 2, {}), 1, False)
    off = [LlamaMeasurement(4.0, [_completion([7, 8]), _completion([9, 2])]),
           LlamaMeasurement(6.0, [_completion([7, 8]), _completion([9, 2])])]
    spec = [LlamaMeasurement(2.0, [_completion([7, 8], 6, 3), _completion([9, 2], 2, 1)],
                             num_drafts=2, num_draft_tokens=8, num_accepted_tokens=4)]
    row = peer_row(case, "ngram-simple:4", spec, off, pagedllm_off=[[7, 8], [9, 5]])
    assert (row.engine, row.speculation, row.output_tokens) == ("llama.cpp", "ngram-simple:4", 4)
    assert row.speedup == pytest.approx(5.0 / 2.0) and row.tok_s == pytest.approx(2.0)
    assert row.same_tokens_as_off is True
    assert row.acceptance_rate == 0.5 and row.mean_acceptance_length == 1 + 4 / 2
    assert row.vs_pagedllm_off == {"same_tokens": False, "first_difference": {
        "request": 1, "token": 1, "lengths": [2, 2]}}
    assert [q["draft_n"] for q in row.per_request] == [6, 2]
    base = peer_row(case, "off", off, off, pagedllm_off=[[7, 8], [9, 2]])
    assert base.speedup == pytest.approx(1.0) and base.acceptance_rate is None
    # speculation that changed llama.cpp's answers (here one token longer): tok/s compare
    longer = [LlamaMeasurement(2.0, [_completion([7, 8, 3]), _completion([9, 2])])]
    changed = peer_row(case, "ngram-mod:24", longer, off, pagedllm_off=None)
    assert changed.same_tokens_as_off is False and changed.vs_pagedllm_off is None
    assert changed.speedup == pytest.approx((5 / 2.0) / (4 / 5.0))
    table = format_spec_table([base, row])
    assert "llama.cpp" in table and "ngram-simple:4" in table
    assert "llama.cpp off vs pagedllm off, code-edit x1: greedy tokens identical" in table


def test_spec_runs_the_engine_as_auto_where_auto_names_the_default_dtype():
    assert spec_engine_dtype(["auto"]) == "auto"
    assert spec_engine_dtype(["float32"]) == "float32"


@needs_llama_server
def test_a_tiny_real_run_drafts_accepts_and_keeps_llamacpps_greedy_tokens():
    """llama-server with ngram-simple and ngram-mod beside off, and pagedllm off, on two
    code-edit prompts (12 tokens each): the answer copies the prompt's code, so n-gram
    drafts come at once."""
    source = load_model_source(default_model_path())
    w = wl.spec_workload("code-edit", source.tokenizer, 12)
    case = SpecCase(w, 1, ignore_eos=True)
    peer = LlamaSpecPeer(LLAMA_SERVER, default_model_path(), "float32", 1, 1,
                         max(r.prompt_len + r.output_len for r in case.requests),
                         parse_llama_spec("ngram-simple:2,ngram-mod:16"), k=4)
    bench = SpecBench(None, {"kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 1024,
                             "enable_prefix_caching": False, "num_threads": 1},
                      ["off"], k=4, rounds=1, peer=peer)
    try:
        rows = bench.run([case])
    finally:
        bench.close()
    assert [(r.engine, r.speculation) for r in rows] == [
        ("pagedllm", "off"), ("llama.cpp", "off"), ("llama.cpp", "ngram-simple:2"),
        ("llama.cpp", "ngram-mod:16")]
    _, llama_off, simple, mod = rows
    assert llama_off.num_draft_tokens == 0 and llama_off.speedup == pytest.approx(1.0)
    assert all(r.output_tokens == 24 for r in rows)
    assert simple.num_drafts > 0 and 0 < simple.num_accepted_tokens <= simple.num_draft_tokens
    assert simple.num_draft_tokens == sum(q["draft_n"] for q in simple.per_request)
    assert 1 < simple.mean_acceptance_length <= 1 + 4
    # whether llama.cpp's speculation keeps its greedy tokens is reported, not required
    assert simple.same_tokens_as_off in (True, False) and mod.same_tokens_as_off in (True, False)
    assert all(q["cache_n"] == 0 for r in rows[1:] for q in r.per_request)   # no prompt cache
    assert llama_off.vs_pagedllm_off is not None
    assert "--spec-ngram-simple-size-n" in peer.commands["ngram-simple:2"]
