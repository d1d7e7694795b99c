"""Tool-call parsers, their forcing grammars, the reasoning split and the streamed deltas of
a chat reply, on texts (no model)."""
from __future__ import annotations

import json

import llguidance
import pytest

from pagedllm.entrypoints.openai.chat_utils import conversation
from pagedllm.entrypoints.openai.protocol import ChatMessage, Tool
from pagedllm.entrypoints.openai.reasoning import PARSERS as REASONING
from pagedllm.entrypoints.openai.serving import _Reply, _ReplyStream
from pagedllm.entrypoints.openai.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser,
                                                      parser_for_template)
from pagedllm.loader import load_model_source

TOOLS = [{"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"},
                                              "unit": {"enum": ["c", "f"]}},
             "required": ["city"]}},
         {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}]
CALLS = [("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 1, "b": -2})]

TEXTS = {
    "hermes": "Let me check.\n" + "\n".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in CALLS),
    "llama3_json": "<|python_tag|>" + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in CALLS),
    "mistral": "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]),
}
PARSERS = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(), "mistral": MistralParser()}


@pytest.fixture(scope="module")
def ll_tokenizer():
    source = load_model_source()
    return source.tokenizer, llguidance.LLTokenizer(source.tokenizer.backend.to_str(),
                                                    n_vocab=source.config.vocab_size, eos_token=2)


@pytest.mark.parametrize("name", list(PARSERS))
def test_parse_finds_every_call_and_the_content(name):
    content, calls = PARSERS[name].parse(TEXTS[name])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert content == ("Let me check." if name == "hermes" else None)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("name", list(PARSERS))
def test_text_without_calls_is_all_content(name):
    for text in ["Just an answer.", "{not json", "<tool_call>\n{\"oops\": 1}\n</tool_call>",
                 "[TOOL_CALLS]garbage"]:
        assert PARSERS[name].parse(text) == (text, [])


def test_mistral_v11_format_and_hermes_cut_short_call():
    content, calls = MistralParser().parse('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    cut = TEXTS["hermes"] + '\n<tool_call>\n{"name": "add", "argu'
    assert [c.name for c in HermesParser().parse(cut)[1]] == ["get_weather", "add"]


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("parallel", [False, True])
def test_forcing_grammar_takes_the_format_and_refuses_others(ll_tokenizer, name, parallel):
    tok, ll_tok = ll_tokenizer
    parser = PARSERS[name]

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_lark(
            parser.grammar(TOOLS, parallel)), log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    one = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
           "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
           "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'}[name]
    assert accepts(one)
    two = {"hermes": TEXTS["hermes"].split("\n", 1)[1],
           "llama3_json": TEXTS["llama3_json"].removeprefix("<|python_tag|>"),
           "mistral": TEXTS["mistral"].replace("},{", "}, {")}[name]
    assert accepts(two) == parallel
    assert not accepts(one.replace('"b": 2', '"c": 2'))  # an undeclared parameter
    assert not accepts(one.replace('"add"', '"sub"'))    # an unknown function
    assert not accepts("Sure, here you go.")


def test_parser_chosen_from_the_template():
    assert isinstance(parser_for_template(None), HermesParser)
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }}"), Llama3JsonParser)
    assert isinstance(parser_for_template("<tool_call>{{ tools }}"), HermesParser)


def test_reasoning_split():
    qwen3, r1 = REASONING["qwen3"](), REASONING["deepseek_r1"]()
    assert qwen3.split("<think>\nhmm\n</think>\n\nHi") == ("hmm", "Hi")
    assert qwen3.split("Hi") == (None, "Hi")
    assert qwen3.split("<think>\nstill thinking</th") == ("still thinking", "")
    assert r1.split("hmm</think>Hi") == ("hmm", "Hi")
    assert r1.split("hmm, more") == ("hmm, more", "")


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streamed_deltas_reassemble_into_the_message(chunk):
    text = "<think>\nweather?\n</think>\n\n" + TEXTS["hermes"]
    reply = _Reply(HermesParser(), REASONING["qwen3"]())
    message, finish = reply.message(text, "stop")
    stream = _ReplyStream(reply)
    deltas = []
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for i, piece in enumerate(pieces):
        deltas += stream.add(piece, "stop" if i == len(pieces) - 1 else None)
    assert deltas[-1] == ({}, "tool_calls") and finish == "tool_calls"
    reasoning = "".join(d.get("reasoning_content", "") for d, _ in deltas)
    content = "".join(d.get("content", "") for d, _ in deltas)
    calls: dict[int, dict] = {}
    for d, _ in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c.get("function", {}).get("name", "")
            entry["arguments"] += c["function"].get("arguments", "")
    assert reasoning == message["reasoning_content"] == "weather?"
    assert content == message["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_a_template_without_tools_is_taught_hermes():
    messages = [ChatMessage(role="user", content="Weather in Oslo?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "call_1", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content='{"t": 3}')]
    tools = [Tool(type="function", function=t) for t in TOOLS]
    rendered, passed = conversation(messages, tools, "{{ messages }}")
    assert passed is None and rendered[0]["role"] == "system"
    assert "<tools>" in rendered[0]["content"] and '"get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Oslo"}}\n</tool_call>')
    assert rendered[3] == {"role": "user", "content": '<tool_response>\n{"t": 3}\n</tool_response>'}
    rendered, passed = conversation(messages, tools, "{{ tools }}{{ messages }}")
    assert passed is not None and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[2]["tool_call_id"] == "call_1"
