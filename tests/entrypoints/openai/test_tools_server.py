"""Tool calling, the reasoning split and the tokenizer endpoints through a real `pagedllm
serve` of the bundled model (started with --reasoning-parser qwen3), driven by the
official openai client."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "How much is 12 plus 30?",
             "Is it raining in Oslo right now?", "Add 7 and 8 for me."]


@pytest.fixture(scope="module")
def tool_server(start_server):
    proc = start_server("tools", ["--reasoning-parser", "qwen3"])
    yield proc
    proc.stop_and_check()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_and_named_tool_choice_always_give_valid_calls(client, model, parallel):
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120,
            temperature=0.8, seed=i, parallel_tool_calls=parallel, n=2)
        for choice in r.choices:
            if choice.finish_reason == "tool_calls":
                check_calls(choice.message, {"get_weather", "add"})
                assert parallel or len(choice.message.tool_calls) == 1
        assert any(c.finish_reason == "tool_calls" for c in r.choices)
        named = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "add"}})
        assert named.choices[0].finish_reason == "tool_calls"
        check_calls(named.choices[0].message, {"add"})
        assert len(named.choices[0].message.tool_calls) == 1


def test_tool_round_trip_yields_an_answer(client, model):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                            max_tokens=40, temperature=0)
    message = answer.choices[0].message
    assert message.content and not message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_reassemble_into_the_plain_result(client, model):
    for question in QUESTIONS[:2]:
        kw = dict(model=model, messages=[{"role": "user", "content": question}], tools=TOOLS,
                  tool_choice="required", max_tokens=120, temperature=0)
        plain = client.chat.completions.create(**kw).choices[0]
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kw, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    entry["id"] = d.id or entry["id"]
                    entry["name"] += (d.function.name or "") if d.function else ""
                    entry["arguments"] += (d.function.arguments or "") if d.function else ""
        assert finish == plain.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in plain.message.tool_calls]
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_reasoning_content_is_split_streamed_and_not(client, model):
    regex = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[A-Z][a-z]{2,8}\."
    kw = dict(model=model, messages=[{"role": "user", "content": "Think, then answer."}],
              max_tokens=60, temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    plain = client.chat.completions.create(**kw).choices[0].message
    reasoning = plain.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "\n" not in reasoning
    assert plain.content and plain.content[0].isupper() and "</think>" not in plain.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            streamed["reasoning_content"] += extra.get("reasoning_content") or ""
            streamed["content"] += choice.delta.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": plain.content}
    # a reply without <think> is all content
    no_think = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}])
    assert no_think.choices[0].message.model_extra["reasoning_content"] is None
    assert no_think.choices[0].message.content


def test_tool_request_errors_name_the_field(client, model):
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "cannot be combined"),
        (dict(extra_body={"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    ]
    for kw, needle in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4, **kw)
        assert needle in str(info.value), (kw, str(info.value))


def test_tokenize_and_detokenize(tool_server, client, model):
    url = tool_server.url
    text = "The capital of France is Paris."
    r = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    completion = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert chat["count"] == completion.usage.prompt_tokens
    with_tools = httpx.post(url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert with_tools["count"] > chat["count"]  # the hermes tool block in the system turn
    for path, body, field in [("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")]:
        bad = httpx.post(url + path, json=body)
        assert 400 <= bad.status_code < 500 and field in bad.text, (body, bad.text)
