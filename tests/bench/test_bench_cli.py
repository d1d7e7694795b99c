"""`pagedllm bench` as a real process on tiny workloads: the JSON it writes is checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
BASE = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench"]
# One thread: on a shared, oversubscribed machine two spinning OpenMP threads per process
# slow everything down far more than one does; the figures are not what is tested here.
TINY = ["--threads", "1", "--num-prompts", "3", "--input-len", "8:24", "--output-len", "3:6", "--prefix-len", "32",
        "--latency-iters", "1", "--quick-machine", "--kv-cache-memory-bytes", str(64 * 2**20)]


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(BASE + args, capture_output=True, text=True, env=ENV, timeout=1800)


@pytest.fixture(scope="module")
def bench_all(tmp_path_factory):
    """One run of every offline workload, pagedllm and HF transformers side by side."""
    out = tmp_path_factory.mktemp("bench")
    json_path = out / "all.json"
    r = run(["all", "--dtype", "float32", "--compare", "hf", "--hf-batch-sizes", "1,3",
             *TINY, "--output-json", str(json_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(json_path.read_text()), out


def rows(doc, engine, workload):
    return [r for r in doc["results"] if r["engine"] == engine and r["workload"] == workload]


@pytest.mark.slow
def test_every_engine_ran_every_workload(bench_all):
    _, doc, _ = bench_all
    got = sorted((r["engine"], r["workload"], r["settings"].get("label", "")) for r in doc["results"])
    assert got == sorted([
        ("hf-transformers", "latency", ""), ("hf-transformers", "prefix", ""),
        ("hf-transformers", "throughput", ""), ("pagedllm", "latency", ""),
        ("pagedllm", "prefix", "prefix caching off"), ("pagedllm", "prefix", "prefix caching on"),
        ("pagedllm", "throughput", "")])


@pytest.mark.slow
def test_every_request_produced_exactly_its_requested_length(bench_all):
    _, doc, _ = bench_all
    workloads = {w["name"]: w for w in doc["workloads"]}
    for r in doc["results"]:
        w = workloads[r["workload"]]
        assert r["exact_output_lens"], r
        assert r["output_tokens"] == r["requested_output_tokens"]
        if r["workload"] != "latency":
            assert r["output_tokens"] == w["output_tokens"]
            assert r["prompt_tokens"] == w["prompt_tokens"]
    assert workloads["latency"]["num_requests"] == 1


@pytest.mark.slow
def test_rows_state_engine_dtype_threads_versions_and_roofline(bench_all):
    _, doc, _ = bench_all
    for r in doc["results"]:
        assert r["dtype"] == "float32" and r["threads"] == 1
        assert r["versions"]["torch"].startswith("2.")
        key = "transformers" if r["engine"] == "hf-transformers" else "pagedllm"
        assert r["versions"][key]
        # A fraction, but of peaks measured by a quick probe in the same run: on a busy
        # machine the probe can read low and an engine land above 1, so only its sanity here.
        assert 0 < r["roofline_fraction"] < 10, r
        if r["workload"] == "latency":
            assert r["serial_fraction"] is None
            assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0
        else:
            assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] and r["req_s"] > 0
            # The serial bound is slower than the roofline, so an engine reaches more of it.
            assert r["serial_fraction"] > r["roofline_fraction"], r
            assert r["roofline"]["serial_tok_s"] < r["roofline"]["tok_s"]
    hw = doc["hardware"]
    assert hw["matmul_gflops"]["float32"] > 0 and hw["memory_read_gbs"] > 0
    assert 0.2 < doc["model"]["cost"]["gflop_per_prompt_token"] < 0.22


@pytest.mark.slow
def test_prefix_caching_rows_differ_in_cached_tokens(bench_all):
    _, doc, _ = bench_all
    by_label = {r["settings"]["label"]: r for r in rows(doc, "pagedllm", "prefix")}
    assert by_label["prefix caching on"]["settings"]["cached_prompt_tokens"] > 0
    assert by_label["prefix caching off"]["settings"]["cached_prompt_tokens"] == 0


@pytest.mark.slow
def test_hf_reports_the_best_of_its_batch_sizes(bench_all):
    _, doc, _ = bench_all
    r = rows(doc, "hf-transformers", "throughput")[0]
    tried = r["settings"]["output_tok_s_by_batch_size"]
    assert set(tried) == {"1", "3"}
    assert r["settings"]["batch_size"] in (1, 3)
    assert r["output_tok_s"] == pytest.approx(max(tried.values()), rel=0.01)


@pytest.mark.slow
def test_table_and_chart_are_written(bench_all):
    r, doc, out = bench_all
    assert "out tok/s" in r.stdout and "hf-transformers" in r.stdout
    bounds = [line for line in r.stdout.splitlines() if line.startswith("bounds ")]
    assert sorted(line.split(":")[0] for line in bounds) == ["bounds prefix float32",
                                                             "bounds throughput float32"]
    assert all("roofline" in line and "serial" in line for line in bounds)
    png = doc["outputs"]["png"]
    assert png == str(out / "all.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_llamacpp_without_a_server_binary_is_a_clear_error(tmp_path):
    env = {k: v for k, v in ENV.items() if k != "PAGEDLLM_LLAMA_SERVER"}
    env["PAGEDLLM_LLAMACPP_DIR"] = str(tmp_path)  # where scripts/build_llamacpp.sh built none
    r = subprocess.run(BASE + ["throughput", "--compare", "llamacpp", *TINY],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2
    assert "--llama-server" in r.stderr


def test_the_bench_commits_the_kv_cache_by_default_and_says_so():
    """The bench's own default for --kv-cache-populate (True) is the one parsed and the one
    its help states; the engine's (False) stays everywhere else."""
    import argparse

    from pagedllm.bench.main import add_bench_args
    from pagedllm.config import EngineConfig

    bench = argparse.ArgumentParser(conflict_handler="resolve")  # as `pagedllm bench`'s
    add_bench_args(bench)
    assert bench.parse_args(["throughput"]).kv_cache_populate is True
    assert bench.parse_args(["throughput", "--no-kv-cache-populate"]).kv_cache_populate is False
    engine = argparse.ArgumentParser()
    EngineConfig.add_cli_args(engine)
    assert engine.parse_args([]).kv_cache_populate is False
    for parser, default in ((bench, True), (engine, False)):
        action = next(a for a in parser._actions if a.dest == "kv_cache_populate")
        assert action.help.endswith(f"(default: {default})")
    with pytest.raises(ValueError, match="kv_cache_populat"):
        EngineConfig.add_cli_args(argparse.ArgumentParser(), defaults={"kv_cache_populat": True})
