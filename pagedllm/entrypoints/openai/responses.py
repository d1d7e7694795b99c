"""OpenAI's /v1/responses, stateless, mapped onto chat completions.

The request's instructions and input items become chat messages (function calls and their
outputs become assistant tool calls and tool messages), its function tools and
text.format become chat tools and response_format; the chat reply becomes output items:
a reasoning item (with --reasoning-parser), a message with output_text, function_call
items. Streamed as the Responses API's events (response.created ... response.completed).
Nothing is stored: previous_response_id, conversation and background are refused.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, _Strict
from pagedllm.entrypoints.openai.streaming import sse


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Loose):  # our own earlier output, sent back: not rendered
    type: Literal["reasoning"]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = None
    # accepted and without effect here (nothing is stored; reasoning is the model's own)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused: this server keeps no state
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None

    def chat_request(self) -> ChatCompletionRequest:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: this server stores no responses; "
                                    f"send the whole conversation as input", name)
        if self.background:
            raise APIError(400, "background responses are not supported", "background")
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = ([MessageItem(role="user", content=self.input)] if isinstance(self.input, str)
                 else self.input)
        for item in items:
            if isinstance(item, MessageItem):
                content = (item.content if isinstance(item.content, str)
                           else "".join(part.text for part in item.content))
                messages.append({"role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.output})
        if not messages:
            raise APIError(400, "input holds no message", "input")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, "text.format json_schema needs a schema", "text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValueError as e:  # pydantic's message names the chat field
            raise APIError(400, f"input or tools: {e}", "input") from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The Response object of one request, its output items added as they are known."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.body: dict[str, Any] = {
            "id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p, "store": False,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "usage": None}

    def finish(self, finish_reason: str | None, prompt_tokens: int, output_tokens: int) -> None:
        if finish_reason == "length":
            self.body["status"] = "incomplete"
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.body["status"] = "completed"
        self.body["usage"] = {"input_tokens": prompt_tokens,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": output_tokens,
                              "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": prompt_tokens + output_tokens}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply message as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(message.get("content") or ""))
    items += [function_call_item(c) for c in message.get("tool_calls") or []]
    return items


async def create_response(serving: Any, req: ResponsesRequest, raw: Request) -> Any:
    from pagedllm.entrypoints.openai.serving import _collect, _event_stream
    prep, reply = await serving.prepare_chat(req.chat_request(), prefix="resp")
    builder = ResponseBuilder(req, serving.model_name)
    if req.stream:
        return _event_stream(_response_events(serving, prep, reply, builder), done=False)
    final = (await _collect(serving._streams(prep), raw))[0]
    c = final.outputs[0]
    message, finish_reason = reply.message(c.text, c.finish_reason)
    builder.body["output"] = output_items(message)
    builder.finish(finish_reason, len(final.prompt_token_ids), len(c.token_ids))
    return builder.body


async def _response_events(serving: Any, prep: Any, reply: Any, builder: ResponseBuilder
                           ) -> AsyncIterator[str]:
    """The Responses API's stream: response.created, then per output item its added /
    delta / done events, then response.completed with the whole response."""
    from pagedllm.entrypoints.openai.serving import _ReplyStream
    seq = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    body = builder.body
    yield event("response.created", response=body)
    yield event("response.in_progress", response=body)
    stream = _ReplyStream(reply)
    output: list[dict[str, Any]] = body["output"]
    open_item: dict[str, Any] | None = None   # the reasoning or message item being streamed

    def close_open() -> list[str]:
        nonlocal open_item
        if open_item is None:
            return []
        item, open_item = open_item, None
        index = output.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=part["text"],
                                logprobs=[]))
            events.append(event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=part))
        else:
            part = item["content"][0]
            events.append(event("response.reasoning_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=part["text"]))
        item["status"] = "completed"
        events.append(event("response.output_item.done", output_index=index, item=item))
        return events

    def open_new(item: dict[str, Any]) -> list[str]:
        nonlocal open_item
        events = close_open()
        open_item = item
        output.append(item)
        index = len(output) - 1
        events.append(event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            events.append(event("response.content_part.added", item_id=item["id"],
                                output_index=index, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []}))
        return events

    final = None
    finish_reason = None
    output_tokens = 0
    async for _, c, text, _, out in serving._deltas(prep):
        output_tokens = len(c.token_ids)
        final = out
        for delta, finish in stream.add(text, c.finish_reason):
            finish_reason = finish or finish_reason
            if "reasoning_content" in delta:
                if open_item is None or open_item["type"] != "reasoning":
                    for e in open_new(reasoning_item("")):
                        yield e
                assert open_item is not None
                open_item["content"][0]["text"] += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=open_item["id"],
                            output_index=output.index(open_item), content_index=0,
                            delta=delta["reasoning_content"])
            if "content" in delta:
                if open_item is None or open_item["type"] != "message":
                    for e in open_new(message_item("", "in_progress")):
                        yield e
                assert open_item is not None
                open_item["content"][0]["text"] += delta["content"]
                yield event("response.output_text.delta", item_id=open_item["id"],
                            output_index=output.index(open_item), content_index=0,
                            delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls", []):
                if "id" not in call:
                    continue  # (the arguments follow in the next delta; sent whole below)
                for e in close_open():
                    yield e
                item = function_call_item({"id": call["id"], "function": {
                    "name": call["function"]["name"], "arguments": ""}}, "in_progress")
                output.append(item)
                index = len(output) - 1
                yield event("response.output_item.added", output_index=index, item=item)
                item["arguments"] = stream.calls[call["index"]].arguments
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=item["arguments"])
                item["status"] = "completed"
                yield event("response.output_item.done", output_index=index, item=item)
    if not output:  # an empty reply is still a message
        for e in open_new(message_item("", "in_progress")):
            yield e
    for e in close_open():
        yield e
    builder.finish(finish_reason, len(final.prompt_token_ids) if final else 0, output_tokens)
    kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
    yield event(kind, response=body)
