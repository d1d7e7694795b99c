"""The llama-bench peer, driven against a stand-in binary that records its arguments and
answers as llama-bench's `-o json` does (the real one needs scripts/build_llamacpp.sh)."""
from __future__ import annotations

import json
import os
import stat
import statistics
import subprocess
import sys

import pytest

from pagedllm.bench.llamacpp_runner import LlamaBenchRunner, default_llama_bench
from pagedllm.bench.workloads import BenchRequest, Workload
from pagedllm.loader import default_model_path

# {crash}: a condition on args under which it dies of SIGSEGV, as llama.cpp's AMX backend
# does on some Xeons (llama.cpp issue #20824)
FAKE = """#!/usr/bin/env python3
import json, os, signal, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 1 (fake)"); sys.exit(0)
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if {crash}:
    os.kill(os.getpid(), signal.SIGSEGV)
get = lambda flag: int(args[args.index(flag) + 1])
p, n, r = get("-p"), get("-n"), get("-r")
rates = [200.0, 100.0, 400.0][:r] if p else [50.0, 40.0, 60.0][:r]
print(json.dumps([{{"n_prompt": p, "n_gen": n, "n_depth": get("-d"), "samples_ts": rates}}]))
"""


REPACKED = 'args[args.index("--repack") + 1] == "1"'


def write_fake(tmp_path, crash: str = "False"):
    log = tmp_path / "calls.jsonl"
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE.format(log=str(log), crash=crash))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary, log


def repack_flags(log) -> list[str]:
    return [c[c.index("--repack") + 1] for c in map(json.loads, log.read_text().splitlines())]


@pytest.fixture
def fake_bench(tmp_path):
    (tmp_path / "llama-server").write_text("")
    return write_fake(tmp_path)


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


def test_one_that_segfaults_repacked_runs_again_without_repacking(tmp_path):
    binary, log = write_fake(tmp_path, crash=REPACKED)
    runner = LlamaBenchRunner(str(binary), "m.gguf", "float32", threads=1)
    assert runner.settings()["repack"] is True
    run = runner.latency(Workload("latency", "", [BenchRequest(list(range(50)), 8)]), iters=1)
    assert run.ttft_s == [0.25] and run.decode_tok_s == [50.0]
    assert repack_flags(log) == ["1", "0", "0"]  # the crash, its rerun, then the decode test
    assert runner.settings()["repack"] is False


def test_one_that_crashes_anyway_is_an_error(tmp_path):
    binary, _ = write_fake(tmp_path, crash="True")
    runner = LlamaBenchRunner(str(binary), "m.gguf", "float32", threads=1)
    with pytest.raises(RuntimeError, match="llama-bench exited with code -11"):
        runner.latency(Workload("latency", "", [BenchRequest([1, 2], 4)]), iters=1)


def test_repack_off_is_asked_for_from_the_start(tmp_path):
    # --llama-no-repack: llama.cpp's faster layout on some CPUs, no crash needed
    binary, log = write_fake(tmp_path, crash=REPACKED)
    runner = LlamaBenchRunner(str(binary), "m.gguf", "float32", threads=1, repack=False)
    runner.latency(Workload("latency", "", [BenchRequest(list(range(50)), 8)]), iters=1)
    assert repack_flags(log) == ["0", "0"]
    assert runner.settings()["repack"] is False


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
    # an int8 cache: llama.cpp's 8-bit one
    runner = LlamaBenchRunner(str(binary), "m.gguf", "bfloat16", threads=1, kv_dtype="int8")
    assert runner.settings()["kv_cache_type"] == "q8_0"
    with pytest.raises(ValueError, match="KV cache 'int4'"):
        LlamaBenchRunner(str(binary), "m.gguf", "float32", threads=1, kv_dtype="int4")


def run_latency_bench(fake_bench, tmp_path, *args: str) -> tuple[dict, dict, dict]:
    """`pagedllm bench latency --compare llamabench` on the bundled model against the
    stand-in llama-bench, with args added: the JSON and its pagedllm and llama-bench rows."""
    binary, _ = fake_bench
    server = binary.parent / "llama-server"
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "lat.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "latency",
           "--compare", "llamabench", "--llama-server", str(server), "--threads", "1",
           "--input-len", "40", "--output-len", "4", "--quick-machine",
           "--kv-cache-memory-bytes", str(64 * 2**20), "--output-json", str(out), *args]
    env = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    ours, theirs = (next(x for x in doc["results"] if x["engine"].startswith(e))
                    for e in ("pagedllm", "llama-bench"))
    return doc, ours, theirs


def test_llama_cpp_gets_the_same_gguf_when_pagedllm_keeps_it_quantized(fake_bench, tmp_path):
    """Without --llama-gguf, a GGUF model whose weights pagedllm keeps quantized goes to
    llama.cpp as it is (the same weights; converting a 30B file to BF16 would write 61 GB),
    its rows labelled with the file; a dequantized run's peer gets the converted file."""
    _, log = fake_bench
    _, ours, theirs = run_latency_bench(fake_bench, tmp_path, "--latency-iters", "1")
    files = {c[c.index("-m") + 1] for c in map(json.loads, log.read_text().splitlines())}
    if ours["settings"]["quantization"] == "gguf":
        assert files == {default_model_path()}
        assert theirs["settings"]["label"] == os.path.basename(default_model_path())
    else:  # (a CPU without the GGUF kernels dequantizes: llama.cpp gets that precision)
        assert len(files) == 1 and files.pop().endswith(("F32.gguf", "BF16.gguf"))


def test_latency_rounds_alternate_with_llama_bench_and_pool_the_runs(fake_bench, tmp_path):
    """--latency-rounds 3: pagedllm (loaded once) and llama-bench in turn, three rounds; each
    engine's runs pooled, each round's decode ratio kept."""
    _, log = fake_bench
    doc, ours, theirs = run_latency_bench(fake_bench, tmp_path, "--llama-gguf",
                                          default_model_path(), "--latency-iters", "2",
                                          "--latency-rounds", "3")
    assert ours["settings"]["rounds"] == theirs["settings"]["rounds"] == 3
    assert ours["settings"]["iterations"] == theirs["settings"]["iterations"] == 6
    assert theirs["settings"]["decode_tok_s_all"] == [50.0, 40.0] * 3  # the fake's samples
    by_round = ours["settings"]["decode_vs_llama_bench_by_round"]
    pooled = ours["settings"]["decode_tok_s_all"]
    assert by_round == [round(statistics.median(pooled[2 * i:2 * i + 2]) / 45.0, 3)
                        for i in range(3)]
    assert len(log.read_text().splitlines()) == 6  # prompt and decode tests, each round
    assert any("3 alternating rounds" in n for n in doc["notes"])


def test_pagedllms_latency_runs_never_find_the_prompt_cached():
    """Each latency iteration's TTFT is the whole prompt's: the runner forgets the prefix
    cache first (as llama-bench computes every prompt)."""
    from pagedllm.bench.pagedllm_runner import PagedLLMRunner

    runner = PagedLLMRunner(None, "float32", 1, {"kv_cache_memory_bytes": 64 * 2**20})
    try:
        w = Workload("latency", "", [BenchRequest(list(range(100, 164)), 3)])
        run = runner.latency(w, iters=3)
        assert run.output_lens == [3, 3, 3]
        bm = runner.llm.engine.scheduler.block_manager
        assert bm.num_query_tokens >= 3 * 48 and bm.num_hit_tokens == 0
        assert bm.num_cached_free_blocks >= 4  # the last run's blocks, kept for a user's next
    finally:
        runner.close()
