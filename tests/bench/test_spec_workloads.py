"""`pagedllm bench spec`: its chat workloads build through the model's chat template, a
tiny run of every speculation setting completes with the same greedy tokens and reports
acceptance, and the CLI writes the JSON. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.bench import workloads as wl
from pagedllm.bench.report import format_spec_table
from pagedllm.bench.spec import (SpecBench, SpecCase, build_cases, decode_seconds,
                                 speculative_config)
from pagedllm.bench.spec_prompts import FAMILIES
from pagedllm.loader import default_model_path, load_model_source
from pagedllm.outputs import RequestMetrics, RequestOutput


@pytest.fixture(scope="module")
def source():
    return load_model_source(default_model_path())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_renders_eight_distinct_chat_prompts(source, family):
    tok = source.tokenizer
    w = wl.spec_workload(family, tok, 64)
    assert len(w.requests) == 8 and len({tuple(r.prompt_token_ids) for r in w.requests}) == 8
    for r in w.requests:
        assert 150 <= r.prompt_len <= 1024 and r.output_len == 64
        text = tok.decode(r.prompt_token_ids, skip_special_tokens=False)
        assert text.rstrip().endswith("<|im_start|>assistant")   # the generation prompt
    assert w.summary()["params"] == {"family": family, "max_output_len": 64, "ignore_eos": False}


def test_code_edit_prompts_hold_a_40_to_80_line_function():
    for conversation in FAMILIES["code-edit"]():
        code = conversation[-1]["content"].split("```python\n")[1].split("```")[0]
        assert 40 <= len(code.splitlines()) <= 80


def test_unknown_family_and_setting_are_rejected_clearly(source):
    with pytest.raises(ValueError, match="unknown speculative-decoding family"):
        wl.spec_workload("poetry", source.tokenizer)
    for bad in ("eagle", "self:0", "self:x", "self", "draft:"):
        with pytest.raises(ValueError, match="unknown speculation setting"):
            speculative_config(bad, 4)


def test_draft_settings_name_the_engines_speculative_config():
    assert speculative_config("self:6", 3) == {
        "method": "self", "num_draft_layers": 6, "num_speculative_tokens": 3}
    assert speculative_config("draft:/m/small.gguf", 2) == {
        "model": "/m/small.gguf", "num_speculative_tokens": 2}
    assert speculative_config("off", 4) is None


def test_cases_cover_every_family_and_stream_count_then_w1_and_w2(source):
    cases = build_cases(source.tokenizer, ["code-edit", "agent"], [1, 8], 32, 4,
                        source.config.vocab_size)
    assert [(c.workload.name, c.streams, len(c.requests)) for c in cases] == [
        ("code-edit", 1, 2), ("code-edit", 8, 8), ("agent", 1, 2), ("agent", 8, 8),
        ("throughput", 4, 4), ("latency", 1, 1)]
    assert [c.ignore_eos for c in cases] == [False] * 4 + [True] * 2


def test_decode_seconds_are_the_union_of_the_requests_decoding_spans():
    def output(first: float | None, finished: float | None) -> RequestOutput:
        metrics = RequestMetrics(0.0, first_token_time=first, finished_time=finished)
        return RequestOutput("r", None, [1], [], True, metrics)

    assert decode_seconds([output(1.0, 3.0), output(5.0, 6.5)]) == 3.5   # one after another
    assert decode_seconds([output(1.0, 4.0), output(2.0, 3.0), output(3.5, 5.0)]) == 4.0
    assert decode_seconds([output(1.0, 2.0), output(None, None)]) == 1.0  # (an error)
    assert decode_seconds([]) == 0.0


def test_a_tiny_run_of_every_setting_gives_the_same_tokens_and_reports_acceptance(source):
    w = wl.spec_workload("code-edit", source.tokenizer, 24)
    case = SpecCase(w, 2, ignore_eos=True)
    bench = SpecBench(None, {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20,
                             "max_model_len": 1024, "enable_prefix_caching": False},
                      ["off", "ngram", "suffix"], k=4, rounds=1)
    try:
        rows = bench.run([case])
    finally:
        bench.close()
    assert [r.speculation for r in rows] == ["off", "ngram", "suffix"]
    off, ngram, suffix = rows
    assert off.speedup == pytest.approx(1.0) and off.num_draft_tokens == 0
    assert off.acceptance_rate is None and off.mean_acceptance_length is None
    for r in (ngram, suffix):
        assert r.same_tokens_as_off and r.output_tokens == 48 and len(r.per_request) == 2
        assert 0 < r.num_accepted_tokens <= r.num_draft_tokens
        assert r.acceptance_rate == r.num_accepted_tokens / r.num_draft_tokens
        assert 1 < r.mean_acceptance_length <= 1 + 4
        assert all(q["mean_acceptance_length"] is not None for q in r.per_request)
    assert off.draft_seconds is None and ngram.draft_seconds is None
    assert off.decode_speedup == pytest.approx(1.0)
    for r in rows:  # 2 requests of 24 tokens: 23 each after the prefill's
        assert 0 < r.decode_s < r.seconds
        assert r.decode_tok_s == pytest.approx(46 / r.decode_s)
    table = format_spec_table(rows)
    assert "code-edit" in table and "suffix" in table and "NO" not in table


def test_self_speculation_reports_the_time_spent_in_its_draft(source):
    w = wl.spec_workload("agent", source.tokenizer, 12)
    bench = SpecBench(None, {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20,
                             "max_model_len": 1024, "enable_prefix_caching": False},
                      ["off", "self:4"], k=2, rounds=1)
    try:
        off, self_spec = bench.run([SpecCase(w, 1, ignore_eos=True)])
    finally:
        bench.close()
    assert self_spec.speculation == "self:4" and self_spec.same_tokens_as_off
    assert self_spec.num_draft_tokens > 0
    assert 0 < self_spec.draft_seconds < self_spec.seconds
    assert "in draft" in format_spec_table([off, self_spec])


@pytest.mark.slow
def test_bench_spec_cli_writes_the_table_and_json(tmp_path):
    json_path = tmp_path / "spec.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "spec", "--threads", "1",
           "--dtype", "float32", "--spec-families", "agent", "--spec-streams", "2",
           "--output-len", "12", "--spec-k", "3", "--spec-random-prompts", "0",
           "--kv-cache-memory-bytes", str(64 * 2**20), "--output-json", str(json_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mean acc. len" in r.stdout
    doc = json.loads(json_path.read_text())
    assert [(x["workload"], x["speculation"]) for x in doc["results"]] == [
        ("agent", "off"), ("agent", "ngram"), ("agent", "suffix")]
    assert all(x["same_tokens_as_off"] for x in doc["results"])
    assert doc["engine"]["enable_prefix_caching"] is False
