"""/v1/responses and Anthropic's /v1/messages on a real `pagedllm serve`, driven by the
official openai and anthropic clients: text, instructions/system, stop sequences,
structured output, a function tool round trip, streamed and not (streams reassemble into
the non-streamed result)."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"]}
QUESTION = "What is the weather in Rome?"


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


# ---- /v1/responses ---------------------------------------------------------------------------

def test_responses_text_streamed_and_not(client, model):
    kw = dict(model=model, input="What is the capital of France?", instructions="Be brief.",
              max_output_tokens=40, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.output_text and r.output[0].type == "message"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text
    cut = client.responses.create(**{**kw, "max_output_tokens": 2})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_function_call_round_trip(client, model):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": PARAMS}]
    kw = dict(model=model, input=QUESTION, tools=tools, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function",
                                                               "name": "get_weather"}})
    assert [o.type for o in named.output] == ["function_call"]
    answer = client.responses.create(model=model, tools=tools, max_output_tokens=30, temperature=0,
                                     input=[{"role": "user", "content": QUESTION},
                                            {"type": "function_call", "call_id": calls[0].call_id,
                                             "name": "get_weather", "arguments": calls[0].arguments},
                                            {"type": "function_call_output",
                                             "call_id": calls[0].call_id, "output": "sunny, 25 C"}])
    assert answer.output_text


def test_responses_json_schema_and_refusals(client, model):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(model=model, input="Capital of France, as JSON.", temperature=0,
                                max_output_tokens=60, text={"format": {
                                    "type": "json_schema", "name": "a", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    for kw, needle in [(dict(previous_response_id="resp_1"), "previous_response_id"),
                       (dict(background=True), "background")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            client.responses.create(model=model, input="hi", **kw)


# ---- /v1/messages ----------------------------------------------------------------------------

def test_messages_text_system_and_stop_sequence_streamed_and_not(claude, model):
    kw = dict(model=model, max_tokens=40, system="Be brief.",
              messages=[{"role": "user", "content": "What is the capital of France?"}],
              extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "end_turn" and m.content[0].type == "text" and m.content[0].text
    assert m.id.startswith("msg_") and m.usage.input_tokens > 0
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == m.content[0].text
    word = m.content[0].text.split()[2]  # a word the greedy reply holds
    stopped = claude.messages.create(**{**kw, "stop_sequences": [word]})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text
    cut = claude.messages.create(**{**kw, "max_tokens": 2})
    assert cut.stop_reason == "max_tokens"


def test_messages_tool_use_round_trip(claude, model):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": PARAMS}]
    kw = dict(model=model, max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
              tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
              extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, PARAMS)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(u.name, u.input) for u in uses]
    named = claude.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.stop_reason == "tool_use"
    answer = claude.messages.create(
        model=model, max_tokens=30, tools=tools, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": [u.model_dump() for u in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": "sunny, 25 C"}]}])
    assert answer.content and answer.content[0].type == "text"


def test_messages_structured_output_and_errors(claude, model):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    m = claude.messages.create(model=model, max_tokens=30, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": "A city, as JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        claude.messages.create(model=model, max_tokens=4, tool_choice={"type": "tool"},
                               tools=[{"name": "f", "input_schema": PARAMS}],
                               messages=[{"role": "user", "content": "x"}])
