"""The OpenAI-compatible server, as a real process, driven by the official `openai` client.

References are independent of the server: LLM.generate / LLM.chat in this process (same
weights, greedy, fp32) and HF transformers for one completion.
"""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
import torch

from pagedllm import LLM, SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference():
    """The offline engine on the same weights: what the server must reproduce (this file's
    own: a test below stops it on purpose)."""
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)


def greedy_text(llm: LLM, prompt: str, max_tokens: int, **kw) -> str:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return llm.generate(prompt, sp, use_tqdm=False)[0].text


def chat_text(llm: LLM, messages: list[dict], max_tokens: int) -> str:
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens),
                    use_tqdm=False)[0].text


def kv_state(server) -> dict:
    return httpx.get(server.url + "/kv_cache", timeout=30).json()


def wait_until_idle(server, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        snap = kv_state(server)
        if snap["stats"]["num_used_blocks"] == 0 and not snap["requests"]:
            return snap
        if time.time() > deadline:
            raise AssertionError(f"blocks still used: {snap['stats']}, {snap['requests']}")
        time.sleep(0.2)


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


# ---- completions and chat ------------------------------------------------------------------


def test_models_lists_the_served_model(client, model):
    assert model == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.slow
def test_completion_equals_hf_greedy(client, model, hf_smollm, reference):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    ids = reference.get_tokenizer().encode(prompt)
    with torch.inference_mode():
        hf = hf_smollm.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12,
                                pad_token_id=2)[0, len(ids):].tolist()
    hf_text = reference.get_tokenizer().decode(hf)
    assert r.choices[0].text == hf_text
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(hf)


def test_chat_completion_and_its_stream_equal_the_offline_chat(client, model, reference):
    want = chat_text(reference, CHAT, 24)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want
    assert "Paris" in want
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1, "the reply must arrive in several pieces"
    assert "".join(deltas) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_streamed_completion_ends_with_done(server, model):
    body = {"model": model, "prompt": "One, two, three,", "max_tokens": 6, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 3


@pytest.mark.slow
def test_stop_string_cuts_the_text_in_both_modes(client, model, reference):
    prompt = "Once upon a time, in a small village by the sea,"
    full = greedy_text(reference, prompt, 40)
    stop = full[12:16]                      # a 4-character string from the middle
    want = full[:full.find(stop)]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], stream=True))
    assert streamed == want


@pytest.mark.slow
def test_seed_gives_the_same_sampled_text_twice(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt="My favourite animal is",
                                         max_tokens=24, temperature=1.0, seed=seed).choices[0].text
    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3)), "different seeds must sample differently"


@pytest.mark.slow
def test_penalties_reach_the_sampler(client, model, reference):
    prompt = "List of fruits: apple, banana, apple, banana,"
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2)
    want = greedy_text(reference, prompt, 24, **kw)
    assert want != greedy_text(reference, prompt, 24), "the penalties must change this output"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.2})
    assert r.choices[0].text == want


def test_chat_logprobs(client, model, reference):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    ref = reference.generate(
        reference.get_tokenizer().encode(reference.get_tokenizer().apply_chat_template(CHAT),
                                         add_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0]
    for entry, lp in zip(content, ref.outputs[0].logprobs):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in lp.top], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token   # greedy picks the most likely


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)


# ---- the job API of seed 004 -------------------------------------------------------------------


@pytest.mark.slow
def test_generate_returns_an_id_at_once_and_result_fills_in(server, reference):
    prompt = "The three primary colors are"
    r = httpx.post(server.url + "/generate",
                   json={"prompt": prompt, "max_tokens": 16, "temperature": 0}, timeout=30)
    assert r.status_code == 200
    job = r.json()
    assert job["status"] in ("queued", "running") and job["id"]
    deadline = time.time() + 120
    while job["status"] not in ("finished", "error"):
        assert time.time() < deadline, job
        time.sleep(0.1)
        job = httpx.get(f"{server.url}/result/{job['id']}", timeout=30).json()
    assert job["status"] == "finished"
    assert job["text"] == greedy_text(reference, prompt, 16)


# ---- continuous batching, disconnects --------------------------------------------------------

PROMPTS = [
    "The capital of France is", "Once upon a time,", "def fibonacci(n):\n",
    "The three primary colors are", "Q: What is 17 * 23?\nA:", "北京是中国的首都，",
    "import numpy as np\n", "My favourite animal is", "The sun rises in the",
    "Water boils at", "A haiku about the sea:\n", "The quick brown fox",
    "In 1492, Columbus", "To make a cup of tea,", "The largest planet is", "Hello, my name is",
]


@pytest.mark.slow
def test_sixteen_concurrent_streams_are_batched_and_each_is_correct(server, model, reference):
    lengths = [8 + 2 * i for i in range(len(PROMPTS))]
    want = [out.text for out in reference.generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False)]
    decode_steps = "pagedllm_step_batch_size_bucket"
    singles_before = metric(server, decode_steps, '{kind="decode",le="1.0"}')
    all_before = metric(server, decode_steps, '{kind="decode",le="+Inf"}')

    async def one(aclient: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=n,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(PROMPTS, lengths)))

    got = asyncio.run(run_all())
    assert got == want
    batched = (metric(server, decode_steps, '{kind="decode",le="+Inf"}') - all_before) - (
        metric(server, decode_steps, '{kind="decode",le="1.0"}') - singles_before)
    assert batched > 0, "no decode step ran more than one request"
    snap = wait_until_idle(server)
    assert snap["stats"]["num_free_blocks"] == snap["stats"]["num_blocks"]


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, model):
    wait_until_idle(server)
    generated_before = metric(server, "pagedllm_generation_tokens_total")
    body = {"model": model, "messages": CHAT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()  # kept referenced: a dropped iterator closes the connection
        tokens = 0
        while tokens < 3:       # read until a few tokens have arrived
            line = next(lines)
            tokens += '"content": "' in line and '"content": ""' not in line
        used_mid_stream = kv_state(server)["stats"]["num_used_blocks"]
    # leaving the block closed the connection mid-stream
    assert used_mid_stream > 0
    wait_until_idle(server)
    generated = metric(server, "pagedllm_generation_tokens_total") - generated_before
    assert generated < 400, "the request ran to the end instead of being aborted"


# ---- the engine loop dying: 503 and no hang --------------------------------------------------


def test_a_dead_engine_loop_gives_503_and_never_hangs(reference, monkeypatch):
    """Fault injection on a real engine: scheduling raises outside the per-batch isolation,
    so the loop itself dies. Waiting streams, new requests and /health all say so."""
    from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError
    from pagedllm.entrypoints.openai.api_server import ServerConfig, create_app

    engine = reference.engine
    llm = AsyncLLM(engine)
    app = create_app(llm, ServerConfig(), "m")

    def broken_schedule():
        raise RuntimeError("injected scheduler fault")

    async def scenario() -> None:
        llm.start()
        monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
        with pytest.raises(EngineDeadError, match="injected scheduler fault"):
            async for _ in llm.generate("Hello", SamplingParams(max_tokens=4), "doomed"):
                pass
        assert not llm.is_alive
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and "Retry-After" in r.headers
            assert r.json()["error"]["code"] == 503
            assert (await http.get("/health")).status_code == 503

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    finally:
        monkeypatch.undo()
        engine.abort_request("doomed")
    assert not engine.has_unfinished_requests()
