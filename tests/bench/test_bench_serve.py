"""`pagedllm bench serve` against the real `pagedllm serve` process (issue 4's server)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# a real server driven by `pagedllm bench serve`, twice (about 25 s)
pytestmark = pytest.mark.slow

ENV = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    proc = subprocess.Popen(CLI + ["serve", "--port", str(port), "--dtype", "float32",
                                   "--kv-cache-memory-bytes", str(64 * 2**20),
                                   "--max-model-len", "256"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not start in 300 s"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_serve_reports_vllm_serving_metrics_with_exact_counts(server_url, tmp_path, prompt_format):
    out = tmp_path / "serve.json"
    r = subprocess.run(CLI + ["bench", "serve", "--base-url", server_url, "--num-prompts", "4",
                              "--input-len", "8:24", "--output-len", "3:6", "--request-rate", "8",
                              "--prompt-format", prompt_format, "--output-json", str(out)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    s = row["serving"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["usage_reported"]
    assert row["exact_output_lens"] and row["output_tokens"] == row["requested_output_tokens"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        m = s[metric]
        assert 0 < m["p50"] <= m["p90"] <= m["p99"], (metric, m)
    assert s["e2el"]["p50"] >= s["ttft"]["p50"]
    assert s["request_throughput"] > 0 and s["total_token_throughput"] > s["output_throughput"] > 0
