"""Anthropic's /v1/messages, mapped onto chat completions: what Claude-style clients and
agents speak.

system and the messages' content blocks (text, tool_use, tool_result) become chat
messages; tools (input_schema) and tool_choice (auto, any, tool, none) become chat tools;
stop_sequences become stop strings. The reply becomes content blocks (thinking with
--reasoning-parser, text, tool_use) with stop_reason end_turn, max_tokens, stop_sequence or
tool_use; streamed as Anthropic's events (message_start ... message_stop). Errors keep
Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, _Strict
from pagedllm.entrypoints.openai.streaming import sse


class _Block(BaseModel):
    """A content block: its type's fields are read, others (metadata the API adds to blocks
    it returns, such as citations or caller) are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Block):  # our own earlier output, sent back: not rendered
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]


class AnthropicTool(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """Anthropic's structured outputs (format) and effort (without effect here)."""

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(_Strict):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # accepted and without effect here (the model thinks as its template says)
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = (self.system if isinstance(self.system, str)
                      else "".join(b.text for b in self.system))
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text, calls = "", []
            for block in m.content:
                if isinstance(block, TextBlock):
                    text += block.text
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": json.dumps(block.input)}})
                elif isinstance(block, ToolResultBlock):
                    if text:
                        messages.append({"role": m.role, "content": text})
                        text = ""
                    result = block.text()
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                     "content": f"Error: {result}" if block.is_error else result})
            if calls:
                messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            elif text:
                messages.append({"role": m.role, "content": text})
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "stop": self.stop_sequences, "top_k": -1 if not self.top_k else self.top_k}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise APIError(400, "tool_choice of type tool needs a name", "tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None


def anthropic_error(err: APIError) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(err.status, "api_error"),
                                       "message": err.message}}


def _stop_reason(finish_reason: str | None, stop_reason: Any, has_calls: bool
                 ) -> tuple[str, str | None]:
    if has_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": arguments}


async def create_message(serving: Any, req: MessagesRequest, raw: Request) -> Any:
    from pagedllm.entrypoints.openai.serving import _collect, _event_stream
    prep, reply = await serving.prepare_chat(req.chat_request(), prefix="msg")
    message_id = "msg_" + uuid.uuid4().hex
    if req.stream:
        return _event_stream(_message_events(serving, prep, reply, message_id), done=False,
                             error=lambda err: sse(anthropic_error(err), event="error"))
    final = (await _collect(serving._streams(prep), raw))[0]
    c = final.outputs[0]
    message, _ = reply.message(c.text, c.finish_reason)
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    content += [_tool_use(call) for call in calls]
    stop_reason, stop_sequence = _stop_reason(c.finish_reason, c.stop_reason, bool(calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": serving.model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(final.prompt_token_ids),
                      "output_tokens": len(c.token_ids)}}


async def _message_events(serving: Any, prep: Any, reply: Any, message_id: str
                          ) -> AsyncIterator[str]:
    from pagedllm.entrypoints.openai.serving import _ReplyStream

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, **fields}, event=kind)

    input_tokens = len(prep.prompts[0])
    yield event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": serving.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0}})
    stream = _ReplyStream(reply)
    index = -1
    open_kind: str | None = None
    last = None

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        events = stop()
        index += 1
        open_kind = kind
        events.append(event("content_block_start", index=index, content_block=block))
        return events

    def stop() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        events = []
        if open_kind == "thinking":
            events.append(event("content_block_delta", index=index,
                                delta={"type": "signature_delta", "signature": ""}))
        open_kind = None
        return events + [event("content_block_stop", index=index)]

    async for _, c, text, _, _ in serving._deltas(prep):
        last = c
        for delta, _ in stream.add(text, c.finish_reason):
            if "reasoning_content" in delta:
                if open_kind != "thinking":
                    for e in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield event("content_block_delta", index=index, delta={
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if "content" in delta:
                if open_kind != "text":
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                yield event("content_block_delta", index=index, delta={
                    "type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls", []):
                if "id" not in call:
                    continue
                block = _tool_use({"id": call["id"], "function": {
                    "name": call["function"]["name"], "arguments": "{}"}})
                for e in start("tool_use", {**block, "input": {}}):
                    yield e
                yield event("content_block_delta", index=index, delta={
                    "type": "input_json_delta",
                    "partial_json": stream.calls[call["index"]].arguments})
    for e in stop():
        yield e
    finish = last.finish_reason if last is not None else None
    stop_reason, stop_sequence = _stop_reason(finish, last.stop_reason if last else None,
                                              bool(stream.calls))
    yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage={"output_tokens": len(last.token_ids) if last else 0})
    yield event("message_stop")
