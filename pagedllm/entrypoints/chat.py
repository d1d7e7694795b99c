"""`pagedllm chat`: an interactive conversation in the terminal, replies streamed."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedllm.sampling_params import SamplingParams

HELP = "Type a message and press Enter. /reset clears the conversation, /exit (or Ctrl-D) quits."


def run_chat(args: argparse.Namespace, sp: SamplingParams, engine_kwargs: dict[str, Any]) -> int:
    from pagedllm.llm import LLM
    llm = LLM(args.model, **engine_kwargs)
    engine, tok = llm.engine, llm.get_tokenizer()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    print(HELP, file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(system)
            continue
        history.append({"role": "user", "content": line})
        prompt = tok.encode(tok.apply_chat_template(history), add_special_tokens=False)
        request_id = f"chat-{turn}"
        turn += 1
        try:
            engine.add_request(request_id, prompt, sp)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    delta = out.text[len(reply):]
                    reply = out.text
                    print(delta, end="", flush=True)
        except KeyboardInterrupt:  # stop this reply, keep the conversation
            engine.abort_request(request_id)
        print()
        history.append({"role": "assistant", "content": reply})
