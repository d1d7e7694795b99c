"""`pagedllm serve --tensor-parallel-size 2` as a real process: the openai client gets the
tokens (and logprobs, and penalised tokens) of one-rank LLM.generate, and stopping the
server leaves none of its worker processes behind."""
from __future__ import annotations

import time

import openai
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from tiny_models import make_qwen3_dir  # tests/ (pytest prepends the rootdir)

PROMPTS = ["Hello, my name is", "def add(a, b):"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_qwen3_dir(tmp_path_factory.mktemp("serve-tp-qwen3"), num_kv_heads=2)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    with LLM(str(qwen3_dir), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
             max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp_server(start_server, qwen3_dir):
    proc = start_server("server-tp2", ["--model", str(qwen3_dir), "--tensor-parallel-size", "2"])
    workers = psutil.Process(proc.proc.pid).children(recursive=True)
    yield proc, [w.pid for w in workers]
    proc.stop_and_check()


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if psutil.pid_exists(p)
                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]):
        assert time.monotonic() < deadline, f"processes left behind: {alive}"
        time.sleep(0.1)


def test_tp2_server_equals_tp1_generate_and_leaves_no_process(tp_server, reference):
    server, pids = tp_server
    assert any("spawn" in " ".join(psutil.Process(p).cmdline()) for p in pids), pids
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=2)
        want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                         logprobs=2), use_tqdm=False)[0]
        assert r.choices[0].text == want.text
        got_lp = r.choices[0].logprobs.token_logprobs
        want_lp = [lp.logprob for lp in want.outputs[0].logprobs]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
    # Penalties are applied on rank 0, which samples from the gathered logits.
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                  frequency_penalty=1.5, presence_penalty=0.5)
    want = reference.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5),
        use_tqdm=False)[0]
    assert r.choices[0].text == want.text

    server.stop_and_check()
    assert_gone(pids)
