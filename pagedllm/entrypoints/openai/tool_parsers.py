"""Tool calls in model output: one parser per format, and the grammar that forces a call.

Formats, with the families that write them:
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call (Qwen2.5, Qwen3, SmolLM2, Hermes; the format pagedllm teaches a model whose chat
  template does not render tools).
- ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` as the whole
  message, after an optional ``<|python_tag|>``, calls separated by ``;`` (Llama 3.x).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects, or
  (tokenizer v11+) ``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral, Mixtral).

A parser splits a finished message into content and calls, and while streaming says how
much of the text so far is surely content (everything before a possible call start).
tool_choice ``required`` and a named function are enforced by a grammar in the parser's
own format (llguidance's Lark with embedded JSON schemas), so the call always parses and
its arguments match the function's parameters.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str   # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    name = ""
    start = ""   # the text that opens a call (the parser's marker)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished message; no calls: the text is all content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a growing text is surely content: up to a call's start, or up to a
        tail that could still become one."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def complete_calls(self, text: str) -> list[ToolCall]:
        """The calls a growing text has completed so far (streaming; formats whose calls
        end only with the message give them all at the end, from parse)."""
        return []

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose sentences are one call (or, with parallel, one
        or more) to one of the tools, arguments matching its parameters."""
        raise NotImplementedError


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    # arguments hold the declared parameters only, unless the schema says otherwise (as
    # OpenAI's strict mode makes it)
    params = {"additionalProperties": False, **(tool.get("parameters") or {"type": "object"})}
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


def _json_rule(schema: dict[str, Any]) -> str:
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                       "key_separator": ": "}}
    return "%json " + json.dumps(schema)


def _arguments_text(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters")))
    return ToolCall(obj["name"], _arguments_text(args))


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body, closed in self._block.findall(text[at:]):
            try:
                call = _call_from(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                if not closed and calls:  # a last call cut short (max_tokens): dropped
                    break
                return text, []  # not a call after all: the text stays content
            calls.append(call)
        content = text[:at].rstrip()
        return content or None, calls

    def complete_calls(self, text: str) -> list[ToolCall]:
        at = text.find(self.start)
        closed = text.rfind("</tool_call>")
        if at < 0 or closed < at:
            return []
        return self.parse(text[:closed + len("</tool_call>")])[1]

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = [f"start: call{'+' if parallel else ''}",
                 f'call: "<tool_call>\\n" ({alternatives}) "\\n</tool_call>"' + (
                     ' "\\n"?' if parallel else "")]
        rules += [f"call_{i}: {_json_rule(_call_schema(t, 'arguments'))}"
                  for i, t in enumerate(tools)]
        return "\n".join(rules)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("{", "<|python_tag|>")) or not stripped or "<|python_tag|>".startswith(stripped):
            return 0  # a call may be starting: hold everything back
        return len(text)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        more = ' ("; " call)*' if parallel else ""
        rules = [f"start: call{more}", f"call: {alternatives}"]
        rules += [f"call_{i}: {_json_rule(_call_schema(t, 'parameters'))}"
                  for i, t in enumerate(tools)]
        return "\n".join(rules)


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        rest = text[at + len(self.start):].strip()
        calls: list[ToolCall] = []
        if rest.startswith("["):
            try:
                items = json.loads(rest)
            except ValueError:
                return text, []
            for obj in items if isinstance(items, list) else [items]:
                call = _call_from(obj, "arguments")
                if call is None:
                    return text, []
                calls.append(call)
        else:  # name[ARGS]{...}, repeated after [TOOL_CALLS]
            for part in rest.split(self.start):
                name, sep, args = part.partition("[ARGS]")
                try:
                    parsed = json.loads(args) if sep else None
                except ValueError:
                    return text, []
                if not sep or not name.strip():
                    return text, []
                calls.append(ToolCall(name.strip(), _arguments_text(parsed)))
        content = text[:at].rstrip()
        return content or None, calls

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        items = f'call (", " call)*' if parallel else "call"
        rules = [f'start: "[TOOL_CALLS][" {items} "]"', f"call: {alternatives}"]
        rules += [f"call_{i}: {_json_rule(_call_schema(t, 'arguments'))}"
                  for i, t in enumerate(tools)]
        return "\n".join(rules)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> ToolParser:
    """The format a chat template teaches (hermes where it teaches none)."""
    source = template or ""
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    if "<|python_tag|>" in source or ('"parameters"' in source and "ipython" in source):
        return Llama3JsonParser()
    return HermesParser()
