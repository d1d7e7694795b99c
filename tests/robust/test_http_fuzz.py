"""Property-based fuzzing of the HTTP API: hostile request bodies never get a 5xx.

Hypothesis starts from a valid /v1/completions or /v1/chat/completions body and puts
one field (or an unknown one) to a hostile value: wrong types, huge and negative numbers,
NaN, unicode edge cases (lone surrogates, NUL, right-to-left marks), very long stop lists,
empty messages, invalid roles, token ids outside the vocabulary. Every answer must be a
success or a 4xx whose error names the field; afterwards the server still answers and
holds no KV block. Also raw bodies that are not JSON at all.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from test_soak import blocks_used, serve_tiny, still_answers, stop_cleanly

# hundreds of hostile requests against a real server (about 20 s)
pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
VOCAB = 261  # tests/tiny_models.py

HUGE = [2**31, 2**63, 2**64, 10**30, -(2**63) - 1, -1, 0]
edge_text = st.sampled_from([
    "", " ", "\x00", "\ud800", "\udfff x", "\u202e\u202d", "\ufeff", "a\u0301" * 50, "🦙" * 30,
    "\r\n" * 20, "<|im_start|>", "<|endoftext|>", "{{ 7 * 7 }}", "{% for x in range(99999) %}",
    "x" * 5000,
]) | st.text(max_size=40)
numbers = (st.sampled_from(HUGE) | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([-0.0, 1e-320, 1e308]))
scalars = st.none() | st.booleans() | numbers | edge_text
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(edge_text, inner, max_size=3), max_leaves=10)

token_ids = st.lists(st.sampled_from([0, 1, VOCAB - 1, VOCAB, VOCAB + 1, -1, 2**31, 2**63])
                     | st.integers(), max_size=20)
FIELD_VALUES = {
    "prompt": values | token_ids | st.lists(token_ids, max_size=3) | st.lists(edge_text, max_size=3),
    "messages": values | st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "root", "", "USER"]) | values,
         "content": edge_text | values}), max_size=3),
    "max_tokens": numbers | values, "max_completion_tokens": numbers | values,
    "temperature": numbers | values, "top_p": numbers | values, "top_k": numbers | values,
    "min_p": numbers | values, "n": numbers | values, "seed": numbers | values,
    "presence_penalty": numbers | values, "frequency_penalty": numbers | values,
    "repetition_penalty": numbers | values, "min_tokens": numbers | values,
    "logprobs": numbers | values, "top_logprobs": numbers | values,
    "stop": values | st.lists(edge_text, min_size=0, max_size=3)
    | st.integers(1000, 5000).map(lambda k: [f"stop{i}" for i in range(k)]),
    "stop_token_ids": token_ids | values, "stream": values, "ignore_eos": values,
    "stream_options": values, "model": values, "user": values,
    "include_stop_str_in_output": values, "skip_special_tokens": values,
    "logit_bias": values | st.dictionaries(edge_text | token_ids.map(str), numbers, max_size=4),
    "allowed_token_ids": token_ids | values,
    "echo": values, "prompt_logprobs": numbers | values,
    "tools": values | st.lists(st.fixed_dictionaries({"type": values, "function": values}), max_size=2),
    "tool_choice": values | st.sampled_from(["auto", "none", "required"]),
    "chat_template_kwargs": values,
    "bad_words": values | st.lists(edge_text, max_size=4),
    "response_format": values | st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]) | values},
        optional={"json_schema": values | st.fixed_dictionaries(
            {"name": edge_text}, optional={"schema": values, "strict": values})}),
    "structured_outputs": values | st.dictionaries(
        st.sampled_from(["json", "json_object", "regex", "choice", "grammar", "other"]),
        values | edge_text | st.sampled_from(
            ["a{1000}{1000}", "(a|b)*c[", "start: x", "root ::= [a-z]+", "[\\w]{1,99999}",
             '{"type": "string", "pattern": "(x+)+y"}']), min_size=1, max_size=2),
}
UNKNOWN_FIELD = "not_a_field"


def base_body(endpoint: str) -> dict:
    body: dict = {"max_tokens": 4, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    return body


@pytest.fixture(scope="module")
def fuzz_server(start_server, tiny_gguf):
    server = serve_tiny(start_server, tiny_gguf, "fuzz")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def check_response(response: httpx.Response, field: str) -> None:
    event(f"{field}: {response.status_code}")
    assert response.status_code < 500, f"{response.status_code} for {field}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        named = f"{error.get('param') or ''} {error['message']}"
        assert field in named, f"the error does not name {field!r}: {error}"
    elif "text/event-stream" in response.headers.get("content-type", ""):
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            error = json.loads(line[6:]).get("error")
            if isinstance(error, dict):  # OpenAI's error body, or Anthropic's error event
                code = error.get("code") or (400 if error.get("type") == "invalid_request_error"
                                             else 500)
                assert code < 500, f"in-stream {code} for {field}: {line[:500]}"


@FUZZ
@given(endpoint=st.sampled_from(["completions", "chat"]), data=st.data())
def test_hostile_field_values_get_4xx_naming_the_field(fuzz_server, client, endpoint, data):
    body = base_body(endpoint)
    fields = [f for f in FIELD_VALUES if f != ("prompt" if endpoint == "chat" else "messages")]
    field = data.draw(st.sampled_from(fields + [UNKNOWN_FIELD]), label="field")
    value = data.draw(FIELD_VALUES.get(field, values), label="value")
    body[field] = value
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    # json.dumps writes NaN / Infinity, which strict JSON does not allow: also a 400.
    content = json.dumps(body).encode("utf-8", errors="surrogatepass")
    response = client.post(fuzz_server.url + path, content=content,
                           headers={"content-type": "application/json"})
    check_response(response, field)


OTHER_ENDPOINTS = {
    "/v1/embeddings": ({"input": "hello"}, {
        "input": values | token_ids | st.lists(token_ids, max_size=3) | st.lists(edge_text, max_size=3),
        "encoding_format": values | st.sampled_from(["float", "base64", "binary"]),
        "dimensions": numbers | values, "model": values, "user": values}),
    "/tokenize": ({"prompt": "hello"}, {
        "prompt": values, "messages": FIELD_VALUES["messages"], "add_special_tokens": values,
        "tools": FIELD_VALUES["tools"], "chat_template_kwargs": values,
        "return_token_strs": values}),
    "/detokenize": ({"tokens": [1, 2]}, {"tokens": token_ids | values}),
    "/v1/responses": ({"input": "hello", "max_output_tokens": 4}, {
        "input": values | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "x"]),
             "role": values, "content": values, "call_id": values, "output": values,
             "arguments": values}), max_size=3),
        "instructions": values, "tools": values | st.lists(st.fixed_dictionaries(
            {"type": values, "name": values, "parameters": values}), max_size=2),
        "tool_choice": values, "max_output_tokens": numbers | values, "text": values,
        "temperature": numbers, "previous_response_id": values, "stream": values}),
    "/v1/messages": ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, {
        "messages": values | st.lists(st.fixed_dictionaries(
            {"role": values, "content": values | st.lists(st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "tool_use", "tool_result", "image"]),
                 "text": values, "id": values, "input": values, "tool_use_id": values,
                 "content": values}), max_size=2)}), max_size=3),
        "system": values, "max_tokens": numbers | values, "stop_sequences": values,
        "tools": values, "tool_choice": values, "output_config": values, "stream": values,
        "temperature": numbers | values, "top_k": numbers | values}),
}


@FUZZ
@given(path=st.sampled_from(sorted(OTHER_ENDPOINTS)), data=st.data())
def test_hostile_values_on_the_other_endpoints(fuzz_server, client, path, data):
    base, fields = OTHER_ENDPOINTS[path]
    field = data.draw(st.sampled_from(sorted(fields) + [UNKNOWN_FIELD]), label="field")
    body = {**base, field: data.draw(fields.get(field, values), label="value")}
    content = json.dumps(body).encode("utf-8", errors="surrogatepass")
    response = client.post(fuzz_server.url + path, content=content,
                           headers={"content-type": "application/json"})
    check_response(response, field)


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
def test_bodies_that_are_not_json(fuzz_server, client, raw, path, content_type):
    response = client.post(fuzz_server.url + path, content=raw, headers={"content-type": content_type})
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"


def test_server_still_serves_and_holds_no_block_after_fuzzing(fuzz_server):
    still_answers(fuzz_server.url)
    assert blocks_used(fuzz_server.url) == 0
