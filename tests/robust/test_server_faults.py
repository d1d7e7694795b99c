"""Faults injected into a real `pagedllm serve` process (PAGEDLLM_FAULT_INJECTION).

* A batch whose forward pass raises: its request gets a 500 with a message (JSON, or an
  error event in the stream); the next requests are served with HF transformers' greedy
  tokens, and no block is leaked.
* One request whose detokenizer raises, among concurrent ones: it alone gets the 500.
* The engine core raising outside a batch: the engine stops and requests in flight get an
  error promptly (never a hang); then the process exits with code 1 and says why (so that a
  supervisor restarts it, as vLLM's server does), or, with --keep-alive-on-engine-death,
  stays up answering 503 (and /health 503).
"""
from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from test_soak import blocks_used, stop_cleanly

SERVE_SMOLLM = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
                str(64 * 737_280)]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n"]
NEW_TOKENS = 8
MARK_MODEL, MARK_DETOK = "KABOOM", "GLITCH"


def start_with_faults(start_server, name: str, spec: str, args: list[str]):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_FAULT_INJECTION", spec)
        return start_server(name, args)


@pytest.fixture(scope="module")
def faulty_server(start_server):
    spec = f"model@prompt~{MARK_MODEL},detokenizer@prompt~{MARK_DETOK}"
    server = start_with_faults(start_server, "faults", spec, SERVE_SMOLLM)
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy_tokens, hf_smollm_tokenizer):
    tokens = hf_greedy_tokens([hf_smollm_tokenizer.encode(p) for p in PROMPTS], NEW_TOKENS)
    return {prompt: hf_smollm_tokenizer.decode(out, skip_special_tokens=True)
            for prompt, out in zip(PROMPTS, tokens)}


def greedy_body(prompt: str, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS,
            "temperature": 0, "stream": stream}


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))


@pytest.mark.slow
def test_failing_forward_pass_gives_500_and_the_server_keeps_serving(faulty_server, hf_greedy):
    url = faulty_server.url
    r = httpx.post(url + "/v1/completions", json=greedy_body(f"{MARK_MODEL} the capital"), timeout=300)
    assert r.status_code == 500, r.text
    assert f"injected fault in model (prompt marker '{MARK_MODEL}')" in r.json()["error"]["message"]
    for response, prompt in zip(asyncio.run(post_all(url, [greedy_body(p) for p in PROMPTS])), PROMPTS):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == hf_greedy[prompt]
    assert blocks_used(url) == 0


@pytest.mark.slow
def test_failing_batch_in_a_stream_ends_with_an_error_event(faulty_server):
    with httpx.stream("POST", faulty_server.url + "/v1/completions", timeout=300,
                      json=greedy_body(f"{MARK_MODEL} streamed", stream=True)) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    errors = [line for line in lines if '"error"' in line]
    assert len(errors) == 1 and '"code": 500' in errors[0].replace('"code":500', '"code": 500')
    assert "injected fault in model" in errors[0]
    assert lines[-1] == "data: [DONE]"
    assert blocks_used(faulty_server.url) == 0


@pytest.mark.slow
def test_detokenizer_fault_fails_only_its_request(faulty_server, hf_greedy):
    bodies = [greedy_body(p) for p in PROMPTS] + [greedy_body(f"{MARK_DETOK} in the text")]
    responses = asyncio.run(post_all(faulty_server.url, bodies))
    assert responses[-1].status_code == 500
    assert "injected fault in detokenizer" in responses[-1].json()["error"]["message"]
    for response, prompt in zip(responses, PROMPTS):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == hf_greedy[prompt]
    assert blocks_used(faulty_server.url) == 0


def crash_with_requests_in_flight(server) -> dict:
    """Two requests run while the injected fault kills the engine core at step 5: both get
    an error that names the engine. Returns their body."""
    body = {"prompt": "hello", "max_tokens": 32, "ignore_eos": True}
    for r in asyncio.run(post_all(server.url, [body, body])):
        assert r.status_code in (500, 503), r.text
        assert "engine" in r.json()["error"]["message"]
    return body


@pytest.mark.slow
def test_engine_core_crash_fails_requests_then_the_server_exits_with_1(start_server, tiny_gguf):
    import time
    from test_soak import TINY_SERVER
    server = start_with_faults(start_server, "core-crash-exit", "core@5",
                               [str(tiny_gguf), *TINY_SERVER])
    try:
        crash_with_requests_in_flight(server)
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.returncode == 1, f"the server did not exit with 1:\n{server.log()}"
        log = server.log()
        assert "engine stopped: scheduling failed: InjectedFault: injected fault in core" in log
        assert "the engine died" in log and "the server stops" in log
    finally:
        server.stop()


def test_engine_core_crash_with_keep_alive_gives_503_and_never_hangs(start_server, tiny_gguf):
    from test_soak import TINY_SERVER
    server = start_with_faults(start_server, "core-crash", "core@5",
                               [str(tiny_gguf), *TINY_SERVER, "--keep-alive-on-engine-death"])
    try:
        body = crash_with_requests_in_flight(server)
        after = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert after.status_code == 503 and after.headers.get("retry-after"), after.text
        assert httpx.get(server.url + "/health", timeout=60).status_code == 503
        assert "engine stopped: scheduling failed: InjectedFault: injected fault in core" in \
            server.log_path.read_text()
    finally:
        code = server.stop()   # the loop is dead, but the process still shuts down cleanly
        assert code in (0, -signal.SIGTERM), server.log()
