"""The llama-bench peer, driven against a stand-in binary that records its arguments and
answers as llama-bench's `-o json` does (the real one needs scripts/build_llamacpp.sh)."""
from __future__ import annotations

import json
import stat

import pytest

from pagedllm.bench.llamacpp_runner import LlamaBenchRunner, default_llama_bench
from pagedllm.bench.workloads import BenchRequest, Workload

FAKE = """#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 1 (fake)"); sys.exit(0)
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
get = lambda flag: int(args[args.index(flag) + 1])
p, n, r = get("-p"), get("-n"), get("-r")
rates = [200.0, 100.0, 400.0][:r] if p else [50.0, 40.0, 60.0][:r]
print(json.dumps([{{"n_prompt": p, "n_gen": n, "n_depth": get("-d"), "samples_ts": rates}}]))
"""


@pytest.fixture
def fake_bench(tmp_path):
    log = tmp_path / "calls.jsonl"
    (tmp_path / "llama-server").write_text("")
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE.format(log=str(log)))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary, log


def test_latency_is_the_prompt_rate_and_the_decode_samples_at_the_prompt_depth(fake_bench):
    binary, log = fake_bench
    assert default_llama_bench(str(binary.parent / "llama-server")) == str(binary)
    runner = LlamaBenchRunner(str(binary), "m.gguf", "bfloat16", threads=2)
    w = Workload("latency", "", [BenchRequest(list(range(100)), 32)])
    run = runner.latency(w, iters=3)
    assert run.ttft_s == [0.5, 1.0, 0.25]          # 100 tokens at 200, 100, 400 tok/s
    assert run.decode_tok_s == [50.0, 40.0, 60.0]
    assert run.output_lens == [32, 32, 32]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    flags = [dict(zip(c[::2], c[1::2])) for c in calls]
    assert [(f["-p"], f["-n"], f["-d"], f["-r"]) for f in flags] == [
        ("100", "0", "0", "3"), ("0", "32", "100", "3")]
    assert all(f["-t"] == "2" and f["-ctk"] == "f16" and f["-m"] == "m.gguf" for f in flags)
    with pytest.raises(NotImplementedError):
        runner.throughput(w)


def test_a_failing_llama_bench_is_a_clear_error(tmp_path):
    binary = tmp_path / "llama-bench"
    binary.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'no model' >&2\nexit 3\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    runner = LlamaBenchRunner(str(binary), "m.gguf", "float32", threads=1)
    with pytest.raises(RuntimeError, match="(?s)llama-bench exited with code 3.*no model"):
        runner.latency(Workload("latency", "", [BenchRequest([1, 2, 3], 4)]), iters=1)


def test_the_cache_type_follows_pagedllms_kv_cache(fake_bench):
    # A GGUF kept quantized under fp32 activations runs a bf16 cache (EngineConfig's auto):
    # llama.cpp gets its own 16-bit type, f16, not an fp32 cache that reads twice the bytes.
    binary, log = fake_bench
    w = Workload("latency", "", [BenchRequest(list(range(10)), 4)])
    for dtype, kv, flag in (("float32", "bfloat16", "f16"), ("float32", None, "f16"),
                            ("bfloat16", "bfloat16", "f16")):
        runner = LlamaBenchRunner(str(binary), "m.gguf", dtype, threads=1, kv_dtype=kv)
        runner.latency(w, iters=1)
        assert runner.settings()["kv_cache_type"] == flag
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert {dict(zip(c[::2], c[1::2]))["-ctk"] for c in calls} == {"f16"}
    with pytest.raises(ValueError, match="KV cache 'int8'"):
        LlamaBenchRunner(str(binary), "m.gguf", "float32", threads=1, kv_dtype="int8")
