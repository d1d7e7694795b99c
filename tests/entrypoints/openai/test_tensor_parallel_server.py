"""`pagedllm serve --tensor-parallel-size N` as a real process: the openai client gets the
tokens (and logprobs, and penalised tokens) of one-rank LLM.generate, and stopping the
server leaves none of its worker processes behind."""
from __future__ import annotations

import time

import openai
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from tiny_models import make_qwen3_dir  # tests/ (pytest prepends the rootdir)

# a tensor-parallel server and its one-rank reference per case (10-30 s each)
pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "def add(a, b):"]


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if psutil.pid_exists(p)
                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]):
        assert time.monotonic() < deadline, f"processes left behind: {alive}"
        time.sleep(0.1)


@pytest.mark.parametrize("model_name, tp", [("qwen3", 2), ("smollm2", 3)])
def test_tp_server_equals_tp1_generate_and_leaves_no_process(model_name, tp, start_server,
                                                             gguf_path, tmp_path):
    """A random Qwen3 (4 heads, 2 KV heads) over 2 ranks; the bundled SmolLM2 over 3."""
    model = (str(make_qwen3_dir(tmp_path / "qwen3", num_kv_heads=2)) if model_name == "qwen3"
             else str(gguf_path))
    max_tokens = 12 if model_name == "qwen3" else 6  # SmolLM2 on 3 ranks, 2 cores: short
    server = start_server(f"server-tp{tp}", ["--model", model, "--tensor-parallel-size", str(tp)])
    try:
        pids = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        workers = [p for p in pids if "spawn_main" in " ".join(psutil.Process(p).cmdline())]
        assert len(workers) == tp - 1, pids
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        served = client.models.list().data[0].id
        got = [client.completions.create(model=served, prompt=p, max_tokens=max_tokens,
                                         temperature=0, logprobs=2).choices[0]
               for p in PROMPTS]
        # Penalties are applied on rank 0, to the logits gathered from every rank.
        penalised = client.completions.create(
            model=served, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0,
            frequency_penalty=1.5, presence_penalty=0.5).choices[0].text
    finally:
        server.stop_and_check()
    assert_gone(pids)

    with LLM(model, dtype="float32", kv_cache_memory_bytes=16 * 2**20, max_model_len=512) as llm:
        want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    logprobs=2), use_tqdm=False)
        want_penalised = llm.generate(PROMPTS[0], SamplingParams(
            temperature=0, max_tokens=max_tokens, frequency_penalty=1.5, presence_penalty=0.5),
            use_tqdm=False)[0].text
    for g, w in zip(got, want):
        assert g.text == w.text
        assert g.logprobs.token_logprobs == pytest.approx(
            [lp.logprob for lp in w.outputs[0].logprobs], abs=1e-4)
    assert penalised == want_penalised
