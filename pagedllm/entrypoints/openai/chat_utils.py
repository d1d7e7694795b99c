"""A chat request's conversation as the model's chat template takes it, tools included.

Messages become the dicts HF chat templates read: an assistant's tool calls carry their
arguments as objects (as transformers passes them), a tool result keeps its
tool_call_id. A template that renders tools gets them as they are. A template that does not
(SmolLM2's, for one) is taught the hermes format by pagedllm instead: the tool signatures
go into the system message in Qwen2.5's words, earlier calls are written as <tool_call>
blocks and tool results as <tool_response> blocks in a user turn, as Qwen2.5's template
writes them.
"""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatMessage, Tool

# Arguments the server passes to the template itself (chat_template_kwargs may not).
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})

_HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{signatures}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def conversation(messages: list[ChatMessage], tools: list[Tool] | None,
                 template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template: tools None where the template is taught them in
    the messages instead (or there are none)."""
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if template_renders_tools(template):
        return [_as_template_message(m) for m in messages], tool_dicts
    rendered = [_as_hermes_text(m) for m in messages]
    if tool_dicts:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts)
        block = _HERMES_TOOLS.format(signatures=signatures)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + block}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_template_message(m: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _as_hermes_text(m: ChatMessage) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    content = m.text()
    for c in m.tool_calls or ():
        call = json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                          ensure_ascii=False)
        content += ("\n" if content else "") + f"<tool_call>\n{call}\n</tool_call>"
    return {"role": m.role, "content": content}
