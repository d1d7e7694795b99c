"""The `pagedllm` command, run as a real process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
BASE = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
ENGINE = ["--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 2**20)]


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(BASE + args, input=stdin, capture_output=True, text=True, env=ENV,
                          timeout=300)


def test_generate_prints_the_completion():
    r = run(["generate", "The capital of France is", "--max-tokens", "4", "--quiet", *ENGINE])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")


@pytest.mark.slow
def test_chat_answers_and_exits():
    r = run(["chat", "--max-tokens", "16", *ENGINE], stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_flag_value_is_a_clear_error():
    r = run(["generate", "hi", "--block-size", "0", *ENGINE])
    assert r.returncode == 2
    assert "block_size must be a positive integer" in r.stderr


def test_serve_on_a_port_in_use_fails_at_once_before_loading_the_model():
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(BASE + ["serve", "--port", str(port), *ENGINE], capture_output=True,
                           text=True, timeout=120,
                           env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "INFO"})
    assert r.returncode == 2, r.stderr
    assert f"pagedllm: error: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "loaded" not in r.stderr  # the model was never loaded
