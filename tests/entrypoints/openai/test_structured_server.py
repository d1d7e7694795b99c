"""Structured outputs and token controls through a real `pagedllm serve`, driven by the
official openai client: `chat.completions.parse` with pydantic models, vLLM's
structured_outputs (regex, choice), logit_bias, and constrained requests batched with
unconstrained ones."""
from __future__ import annotations

import asyncio
import enum
import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=50_000_000)
    capital: bool


class Point(BaseModel):
    x: float = Field(ge=-100, le=100)
    y: float = Field(ge=-100, le=100)


class Path(BaseModel):
    points: list[Point] = Field(min_length=1, max_length=3)


class Paint(BaseModel):
    colour: Colour
    litres: int = Field(ge=1, le=20)


class Address(BaseModel):
    street: str = Field(max_length=24)
    number: int = Field(ge=1, le=999)


class Customer(BaseModel):
    person: Person
    address: Address


class Tags(BaseModel):
    tags: list[str] = Field(max_length=3)


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: str = Field(max_length=30)


class Flag(BaseModel):
    enabled: bool
    reason: str = Field(max_length=16)


class Order(BaseModel):
    item: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=99)
    paints: list[Paint] = Field(max_length=2)


MODELS = [Person, City, Path, Paint, Customer, Tags, Rating, Flag, Order, Point]
PROMPTS = ["Tell me about a person.", "Name a big city.", "Draw a short path.", "Pick a paint.",
           "Describe a customer.", "Tag this photo of a beach.", "Rate the film.",
           "Should the feature be on?", "Place an order for paint.", "Give me a point."]


def test_parse_returns_objects_for_twenty_prompts_and_schemas(client, model):
    """20 (prompt, schema) pairs, n = 2: 10 greedy-ish sampled with a seed, 10 streamed."""
    cases = list(zip(PROMPTS, MODELS)) + list(zip(reversed(PROMPTS), MODELS))
    for i, (prompt, schema) in enumerate(cases):
        messages = [{"role": "user", "content": prompt}]
        if i < len(cases) // 2:
            completion = client.chat.completions.parse(
                model=model, messages=messages, response_format=schema, n=2, max_tokens=160,
                temperature=0.7, seed=i)
            assert len(completion.choices) == 2
            for choice in completion.choices:
                assert isinstance(choice.message.parsed, schema), choice
        else:
            with client.chat.completions.stream(
                    model=model, messages=messages, response_format=schema, max_tokens=160,
                    temperature=0.7, seed=i) as stream:
                final = stream.get_final_completion()
            assert isinstance(final.choices[0].message.parsed, schema)


def test_regex_choice_and_json_object_hold_on_every_output(client, model):
    regex = r"[A-Z]{2}-[0-9]{2,4}"
    out = client.completions.create(model=model, prompt="A product code:", n=3, max_tokens=16,
                                    temperature=1.0, seed=5,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    choices = ["positive", "negative", "neutral"]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "I loved it. Sentiment?"}], n=3,
        temperature=1.0, seed=2, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in chat.choices)
    obj = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Anything, as JSON."}], max_tokens=120,
        temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_logit_bias_and_bad_words(client, model):
    tok_comma = 28  # "," in SmolLM2's vocabulary
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                    temperature=0, logit_bias={str(tok_comma): 100})
    assert out.choices[0].text == ",,,,,"
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                      temperature=0).choices[0].text
    assert "Paris" in plain
    banned = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text


def test_concurrent_constrained_and_plain_requests_each_get_their_own(server, model):
    asyncio.run(_concurrent(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                               max_retries=0, timeout=300), model))


async def _concurrent(aclient: openai.AsyncOpenAI, model: str) -> None:
    schema_kw = dict(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": Person.model_json_schema()}})
    prompts = [f"Say something about the number {i}." for i in range(8)]

    def plain(prompt: str):
        return aclient.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)

    def constrained(prompt: str):
        return aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=80,
            temperature=0, **schema_kw)

    alone = [(await plain(p)).choices[0].text for p in prompts]
    results = await asyncio.gather(*[f(p) for p in prompts for f in (plain, constrained)])
    for i, p in enumerate(prompts):
        assert results[2 * i].choices[0].text == alone[i]
        message = results[2 * i + 1].choices[0]
        if message.finish_reason == "stop":
            Person.model_validate_json(message.message.content)


def test_bad_constraints_are_400s_naming_the_field(client, model):
    cases = [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "frobnicate"}}}}, "does not compile"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "json_schema.schema"),
        ({"logit_bias": {"99999999": 5}}, "outside the vocabulary"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ]
    for body, needle in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=body)
        assert needle in str(info.value), (body, str(info.value))
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices[0].text is not None


def test_echo_logprobs_equal_hf_with_the_prefix_cached(server, client, model, hf_smollm):
    """lm-eval-harness's loglikelihood request (echo, logprobs, max_tokens 0) against HF's
    log-softmax of the prompt, also once the prompt's blocks are in the prefix cache."""
    import torch
    prompt = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the "
              "lazy dog. The quick brown fox jumps over the lazy")
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    with torch.inference_mode():
        ref = hf_smollm(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for attempt in range(2):  # the second finds the prompt cached
        r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=2)
        c = r.choices[0]
        assert c.text == prompt and c.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        assert "".join(lp.tokens) == prompt
        for p in range(1, len(ids)):
            assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
            assert len(lp.top_logprobs[p]) >= 1
        client.completions.create(model=model, prompt=prompt, max_tokens=1)  # cache it
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True))
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    assert streamed == prompt + plain.choices[0].text


def test_embeddings_equal_hf_pooled_hidden_states(server, client, model, hf_smollm):
    """/v1/embeddings (last-token pooling, normalised) of strings and token ids, float and
    base64, against HF's final hidden state of the same prompt (fp32)."""
    import base64

    import numpy as np
    import torch
    texts = ["The capital of France is", "A longer sentence, to embed with the others in a batch."]
    r = client.embeddings.create(model=model, input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    for text_ids, d in zip(ids, r.data):
        with torch.inference_mode():
            hidden = hf_smollm.model(torch.tensor([text_ids])).last_hidden_state[0, -1].float()
        ref = torch.nn.functional.normalize(hidden, dim=0)
        ours = torch.tensor(d.embedding)
        assert torch.nn.functional.cosine_similarity(ours, ref, dim=0).item() > 0.999
    by_ids = client.embeddings.create(model=model, input=ids[0])
    assert by_ids.data[0].embedding == pytest.approx(r.data[0].embedding, abs=1e-6)
    raw = httpx.post(server.url + "/v1/embeddings", json={
        "input": texts[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert decoded.tolist() == pytest.approx(r.data[0].embedding, abs=1e-6)
    hidden_size = len(r.data[0].embedding)
    assert client.embeddings.create(model=model, input="x", dimensions=hidden_size).data
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.embeddings.create(model=model, input=[10**8])
