"""n > 1 choices and beam search through the OpenAI API, driven by the official client.

Each check is judged against the server itself (a seeded sample i equals the n = 1 request
with seed + i) or against the offline engine on the same weights (greedy, beam search).
"""
from __future__ import annotations

import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams

PROMPT = "My favourite animal is"


@pytest.fixture(scope="module")
def reference():
    """The offline engine on the same weights (this file's own: test_openai_api.py stops
    its reference engine on purpose)."""
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)


def wait_until_idle(server, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while True:
        snap = httpx.get(server.url + "/kv_cache", timeout=30).json()
        if snap["stats"]["num_used_blocks"] == 0 and not snap["requests"]:
            return
        if time.time() > deadline:
            raise AssertionError(f"blocks still used: {snap['stats']}, {snap['requests']}")
        time.sleep(0.2)


def test_n3_seeded_returns_three_choices_each_equal_to_its_seed(server, client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                  seed=100, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, f"three samples came out identical: {texts}"
    # Sample i of a seeded request draws from seed + i: the n = 1 request with that seed.
    alone_tokens = 0
    for i, text in enumerate(texts):
        alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                          temperature=1.0, seed=100 + i)
        assert alone.choices[0].text == text
        alone_tokens += alone.usage.completion_tokens
    assert r.usage.completion_tokens == alone_tokens  # every choice's tokens count
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once
    wait_until_idle(server)


@pytest.mark.slow
def test_n2_greedy_stream_per_index_equals_non_streamed(server, client, model, reference):
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0, n=2)
    r = client.completions.create(**kw)
    ref = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10),
                             use_tqdm=False)[0]
    want = ref.text
    assert [c.text for c in r.choices] == [want, want]
    assert r.usage.completion_tokens == 2 * len(ref.token_ids)
    streamed = {0: "", 1: ""}
    finish = {}
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert streamed == {0: want, 1: want}
    assert finish == {c.index: c.finish_reason for c in r.choices}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    wait_until_idle(server)


def test_n2_chat_streamed_equals_non_streamed_and_prompts_times_n(server, client, model):
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=model, messages=messages, max_tokens=8, temperature=0, n=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in r.choices}
    # Two prompts x n = 2: choice i * n + j is sample j of prompt i.
    two = client.completions.create(model=model, prompt=["Red, green,", "One, two,"],
                                    max_tokens=4, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text
    assert two.choices[2].text == two.choices[3].text
    wait_until_idle(server)


@pytest.mark.slow
def test_beam_search_returns_the_n_best_of_the_offline_beam_search(server, client, model,
                                                                   reference):
    want = reference.beam_search([PROMPT], beam_width=3, max_tokens=6, use_tqdm=False)[0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2,
                                  extra_body={"use_beam_search": True, "best_of": 3})
    assert [c.text for c in r.choices] == [c.text for c in want.outputs[:2]]
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2,
                                           stream=True,
                                           extra_body={"use_beam_search": True, "best_of": 3}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: r.choices[0].text, 1: r.choices[1].text}
    wait_until_idle(server)
