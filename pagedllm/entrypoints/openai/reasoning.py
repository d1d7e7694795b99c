"""Reasoning in model output: the text between <think> and </think> becomes the message's
reasoning_content, the rest its content (--reasoning-parser).

- ``qwen3``: the model opens its reasoning with <think> itself; output without it is all
  content (Qwen3 with enable_thinking=False, or any model that did not think).
- ``deepseek_r1``: the chat template opens <think> in the prompt; the output is reasoning
  until </think> (all reasoning if it never closes).
"""
from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, opened_by_prompt: bool) -> None:
        self.opened_by_prompt = opened_by_prompt

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a text so far (a growing one: the reasoning part first)."""
        body = text.lstrip()
        opened = self.opened_by_prompt
        if body.startswith(START):
            body, opened = body[len(START):], True
        elif not opened:
            # a text that may still become <think> holds back as nothing yet
            return (None, "") if START.startswith(body) and body else (None, text)
        reasoning, end, content = body.partition(END)
        if not end:  # (a tail that may become </think> is held back)
            for keep in range(min(len(END) - 1, len(reasoning)), 0, -1):
                if END.startswith(reasoning[-keep:]):
                    reasoning = reasoning[:-keep]
                    break
            return reasoning.strip("\n") or None, ""
        return reasoning.strip("\n") or None, content.lstrip("\n")

    def reasoning_end(self, text: str) -> bool:
        return END in text


PARSERS = {"qwen3": lambda: ReasoningParser(opened_by_prompt=False),
           "deepseek_r1": lambda: ReasoningParser(opened_by_prompt=True)}
