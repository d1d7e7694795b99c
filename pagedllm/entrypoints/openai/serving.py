"""/v1/completions and /v1/chat/completions: requests in, JSON or server-sent events out."""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, QueueFullError
from pagedllm.entrypoints.openai.errors import APIError, error_body
from pagedllm.entrypoints.openai.chat_utils import RESERVED_TEMPLATE_ARGS, conversation
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, EmbeddingRequest,
                                                  NamedToolChoice, Tool, TokenizeRequest)
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import ToolCall, ToolParser, parser_for_template
from pagedllm.entrypoints.openai.streaming import DeltaTracker, merge, sse
from pagedllm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams
from pagedllm.tokenizer import Tokenizer

RETRY_AFTER_SECONDS = 1


@dataclass
class _Prepared:
    """A validated request, ready to run: its prompts (token ids), n choices from each."""

    request_id: str
    created: int
    sampling_params: SamplingParams
    prompts: list[list[int]]
    n: int   # choices per prompt (sampling_params.n, except with a wider beam search)
    include_usage: bool
    finals: list[RequestOutput] = field(default_factory=list)  # filled as requests finish


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None, pooling: str = "last") -> None:
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_name = model_name
        # the tool-call format: --tool-call-parser, else the one the chat template teaches
        self.tool_parser = tool_parser or parser_for_template(self.tokenizer.chat_template)
        self.reasoning_parser = reasoning_parser
        self.pooling = pooling   # of /v1/embeddings: "last" or "mean"

    # ---- shared validation --------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model")

    def _sampling_params(self, build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValueError as e:
            raise APIError(400, str(e), str(e).split()[0]) from None

    async def _compile(self, sp: SamplingParams, param: str) -> None:
        """Compile the request's output constraint off the engine thread (the engine then
        finds it cached): a constraint that does not compile is a 400."""
        if sp.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.grammars.matcher, sp.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    def _prepare(self, prefix: str, prompts: list[str | list[int]], sp: SamplingParams,
                 n: int, include_usage: bool) -> _Prepared:
        try:
            token_ids = [self.engine.prepare(p, sp) for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        self._check_capacity(len(prompts))
        return _Prepared(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), sp, token_ids, n,
                         include_usage)

    def _check_capacity(self, num_requests: int) -> None:
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", headers={"Retry-After": "5"})
        if self.engine.num_waiting + num_requests > self.engine.max_waiting_requests:
            raise APIError(503, f"the server is busy: {self.engine.num_waiting} requests are "
                                f"waiting (limit {self.engine.max_waiting_requests}); retry later",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def _streams(self, prep: _Prepared) -> list[AsyncIterator[RequestOutput]]:
        now = time.time()
        return [self.engine.generate(None, prep.sampling_params, f"{prep.request_id}-{i}", now,
                                     prompt_token_ids=ids)
                for i, ids in enumerate(prep.prompts)]

    # ---- completions --------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        # max_tokens 0 with echo (the prompt's logprobs alone): one token, not returned
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        sp = self._sampling_params(lambda: req.sampling_params(
            1 if prompt_only else req.max_tokens, req.logprobs))
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "prompt")
        await self._compile(sp, _constraint_param(req))
        prep = self._prepare("cmpl", prompts, sp, req.n,
                             bool(req.stream_options and req.stream_options.include_usage))
        echo = _Echo(self, req.echo, prompt_only, req.logprobs, req.prompt_logprobs)
        if req.stream:
            return _event_stream(self._completion_events(prep, echo))
        finals = await _collect(self._streams(prep), raw)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs[:prep.n]:
                choices.append({"index": i * prep.n + c.index, **echo.choice(
                    out, echo.text(out) + ("" if prompt_only else c.text),
                    [] if prompt_only else c.logprobs or [], True),
                    "finish_reason": "length" if prompt_only else c.finish_reason})
        return {"id": prep.request_id, "object": "text_completion", "created": prep.created,
                "model": self.model_name, "choices": choices,
                "usage": _usage(finals, prep.n, counts_generated=not prompt_only)}

    async def _completion_events(self, prep: _Prepared, echo: _Echo) -> AsyncIterator[str]:
        started: set[int] = set()
        async for index, c, text, logprobs, out in self._deltas(prep):
            first = index not in started
            started.add(index)
            if echo.prompt_only:
                text, logprobs = "", []
                if c.finish_reason is None:
                    continue
            if first:
                text = echo.text(out) + text
            yield sse(self._chunk(prep, "text_completion", {
                "index": index, **echo.choice(out, text, logprobs, first),
                "finish_reason": "length" if echo.prompt_only and c.finish_reason else c.finish_reason}))
        if prep.include_usage:
            yield sse(self._usage_chunk(prep, "text_completion", prep.finals,
                                        counts_generated=not echo.prompt_only))

    async def _deltas(self, prep: _Prepared) -> AsyncIterator[
            tuple[int, CompletionOutput, str, list[TokenLogprobs], RequestOutput]]:
        """(choice index, completion, new text, new logprobs, the request's output) whenever
        a choice has news; the finished outputs are left in prep.finals for the usage."""
        n = prep.n
        trackers: dict[int, DeltaTracker] = {}
        finals: dict[int, RequestOutput] = {}
        async with aclosing(merge(self._streams(prep))) as outputs:
            async for i, out in outputs:
                _raise_on_error(out)
                if out.finished:
                    finals[i] = out
                for c in out.outputs[:n]:
                    index = i * n + c.index
                    tracker = trackers.setdefault(index, DeltaTracker(prep.sampling_params))
                    if tracker.done:
                        continue
                    text, logprobs = tracker.delta(c)
                    if text or c.finish_reason is not None:
                        yield index, c, text, logprobs, out
        prep.finals = [finals[i] for i in sorted(finals)]

    def _completion_logprobs(self, logprobs: list[TokenLogprobs | None],
                             first_token: int | None = None) -> dict:
        """OpenAI's completion logprobs; a None entry (the prompt's first token, echoed:
        first_token) has no logprob."""
        tokens, offsets, offset, token_logprobs, tops = [], [], 0, [], []
        for lp in logprobs:
            token = self._token_str(lp.token_id if lp is not None else first_token)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            token_logprobs.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self._token_str(t): v for t, v in lp.top})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _prompt_logprobs(self, logprobs: list[TokenLogprobs | None]) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token, {token id: logprob, rank, decoded token}
        for the token itself and the top alternatives."""
        result: list[dict | None] = []
        for lp in logprobs:
            if lp is None:
                result.append(None)
                continue
            entry = {str(t): {"logprob": v, "rank": rank, "decoded_token": self._token_str(t)}
                     for rank, (t, v) in enumerate(lp.top, start=1)}
            entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None,
                                                "decoded_token": self._token_str(lp.token_id)})
            result.append(entry)
        return result

    # ---- chat ---------------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest, prefix: str = "chatcmpl"
                           ) -> tuple[_Prepared, _Reply]:
        """A chat request validated, rendered and ready to run, and how its text becomes a
        message (also for /v1/responses and /v1/messages, which map onto chat)."""
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        sp = self._sampling_params(lambda: req.sampling_params(max_tokens, num_logprobs))
        tools = self._tools_in_use(req, sp)
        prompt = self.tokenizer.encode(self._render(req, tools is not None),
                                       add_special_tokens=False)  # BOS is in the template
        await self._compile(sp, "tool_choice" if _forces_tool(req) else _constraint_param(req))
        prep = self._prepare(prefix, [prompt], sp, req.n,
                             bool(req.stream_options and req.stream_options.include_usage))
        return prep, _Reply(self.tool_parser if tools is not None else None, self.reasoning_parser)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        prep, reply = await self.prepare_chat(req)
        sp = prep.sampling_params
        num_logprobs = sp.logprobs
        if req.stream:
            return _event_stream(self._chat_events(prep, reply))
        finals = await _collect(self._streams(prep), raw)
        choices = []
        for index, c in _choices(finals, prep.n):
            message, finish_reason = reply.message(c.text, c.finish_reason)
            choices.append({"index": index, "message": message, "finish_reason": finish_reason,
                            "logprobs": self._chat_logprobs(c.logprobs)
                            if num_logprobs is not None else None})
        response = {"id": prep.request_id, "object": "chat.completion", "created": prep.created,
                    "model": self.model_name, "choices": choices, "usage": _usage(finals, prep.n)}
        if sp.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._prompt_logprobs(finals[0].prompt_logprobs or [])
        return response

    def _tools_in_use(self, req: ChatCompletionRequest, sp: SamplingParams) -> list[Tool] | None:
        """The request's tools unless tool_choice is none; for required or a named function,
        sp gets the grammar that forces the call."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        tools = req.tools
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in req.tools if t.function.name == choice.function.name]
            if not tools:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                                    f"among the tools", "tool_choice")
        if _forces_tool(req):
            if sp.use_beam_search:
                raise APIError(400, "tool_choice required or a named function is not supported "
                                    "with beam search", "tool_choice")
            if sp.structured_outputs is not None:
                raise APIError(400, "tool_choice required or a named function cannot be combined "
                                    "with response_format or structured_outputs", "tool_choice")
            functions = [{"name": t.function.name, "parameters": t.function.parameters}
                         for t in tools]
            grammar = self.tool_parser.grammar(functions, req.parallel_tool_calls
                                               and not isinstance(choice, NamedToolChoice))
            sp.structured_outputs = StructuredOutputsParams(grammar=grammar)
        return req.tools

    # ---- embeddings ---------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> dict:
        self.check_model(req.model)
        hidden = self.engine.engine.model_config.hidden_size
        if req.dimensions is not None and req.dimensions != hidden:
            raise APIError(400, f"dimensions: this model's embeddings have {hidden} dimensions; "
                                f"reducing them is not supported", "dimensions")
        inputs = req.inputs()
        if not inputs:
            raise APIError(400, "input is empty", "input")
        sp = SamplingParams(temperature=0, max_tokens=1,
                            pooling=PoolingParams(self.pooling, normalize=True))
        try:
            prompts = [self.engine.prepare(p, sp) for p in inputs]
        except ValueError as e:
            raise APIError(400, str(e), "input") from None
        self._check_capacity(len(prompts))
        prep = _Prepared(f"embd-{uuid.uuid4().hex}", int(time.time()), sp, prompts, 1, False)
        finals = await _collect(self._streams(prep), raw)
        data = []
        for i, out in enumerate(finals):
            vector = out.embedding or []
            embedding: list[float] | str = (
                base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
                if req.encoding_format == "base64" else vector)
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # ---- tokenizer endpoints ------------------------------------------------------------------

    def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", "prompt")
        try:
            if req.prompt is not None:
                add_special = True if req.add_special_tokens is None else req.add_special_tokens
                tokens = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
            else:
                text = self._render(req, req.tools is not None)
                tokens = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        except ValueError as e:
            raise APIError(400, str(e), "prompt" if req.prompt is not None else "messages") from None
        return {"count": len(tokens), "max_model_len": self.engine.engine.config.max_model_len,
                "tokens": tokens,
                "token_strs": [self.tokenizer.id_to_token(t) for t in tokens]
                if req.return_token_strs else None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def _render(self, req: ChatCompletionRequest | TokenizeRequest, with_tools: bool) -> str:
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = RESERVED_TEMPLATE_ARGS & kwargs.keys()
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}",
                           "chat_template_kwargs")
        messages, tools = conversation(req.messages, req.tools if with_tools else None,
                                       self.tokenizer.chat_template)
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tools=tools, **kwargs)
        except Exception as e:  # noqa: BLE001 - the template's own message says what is wrong
            raise APIError(400, f"the chat template failed: {e}", "messages") from None

    async def _chat_events(self, prep: _Prepared, reply: _Reply) -> AsyncIterator[str]:
        sp = prep.sampling_params
        for index in range(len(prep.prompts) * prep.n):
            yield sse(self._chunk(prep, "chat.completion.chunk", {
                "index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}))
        streams: dict[int, _ReplyStream] = {}
        async for index, c, text, logprobs, _ in self._deltas(prep):
            stream = streams.setdefault(index, _ReplyStream(reply))
            for delta, finish_reason in stream.add(text, c.finish_reason):
                yield sse(self._chunk(prep, "chat.completion.chunk", {
                    "index": index, "delta": delta,
                    "logprobs": self._chat_logprobs(logprobs)
                    if sp.logprobs is not None else None,
                    "finish_reason": finish_reason}))
                logprobs = []
        if prep.include_usage:
            yield sse(self._usage_chunk(prep, "chat.completion.chunk", prep.finals))

    def _chat_logprobs(self, logprobs: list[TokenLogprobs] | None) -> dict | None:
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            token = self._token_str(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    # ---- helpers ------------------------------------------------------------------------------

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chunk(self, prep: _Prepared, obj: str, choice: dict) -> dict:
        chunk = {"id": prep.request_id, "object": obj, "created": prep.created,
                 "model": self.model_name, "choices": [choice]}
        if prep.include_usage:
            chunk["usage"] = None
        return chunk

    def _usage_chunk(self, prep: _Prepared, obj: str, finals: list[RequestOutput],
                     counts_generated: bool = True) -> dict:
        return {"id": prep.request_id, "object": obj, "created": prep.created,
                "model": self.model_name, "choices": [],
                "usage": _usage(finals, prep.n, counts_generated)}


class _Echo:
    """A completion choice's text and logprobs, with the prompt echoed before them (echo) and
    vLLM's prompt_logprobs beside them, as asked."""

    def __init__(self, serving: OpenAIServing, echo: bool, prompt_only: bool,
                 logprobs: int | None, prompt_logprobs: int | None) -> None:
        self.serving = serving
        self.echo = echo
        self.prompt_only = prompt_only
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    def text(self, out: RequestOutput) -> str:
        if not self.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.serving.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def choice(self, out: RequestOutput, text: str, logprobs: list[TokenLogprobs],
               first: bool) -> dict:
        """text, logprobs (and prompt_logprobs) of a choice or of its next stream chunk."""
        entries: list[TokenLogprobs | None] = list(logprobs)
        if first and self.echo and self.logprobs is not None:
            entries = list(out.prompt_logprobs or []) + entries
        choice: dict[str, Any] = {
            "text": text,
            "logprobs": self.serving._completion_logprobs(entries, out.prompt_token_ids[0])
            if self.logprobs is not None else None}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = (self.serving._prompt_logprobs(out.prompt_logprobs or [])
                                         if first else None)
        return choice


def _forces_tool(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and (req.tool_choice == "required"
                                or isinstance(req.tool_choice, NamedToolChoice))


class _Reply:
    """A chat completion's text as the message: reasoning split off, tool calls parsed."""

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools = tools
        self.reasoning = reasoning

    def split(self, text: str) -> tuple[str | None, str]:
        return self.reasoning.split(text) if self.reasoning is not None else (None, text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        reasoning, content = self.split(text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            parsed, calls = self.tools.parse(content)
            content = parsed if calls else content
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason


class _ReplyStream:
    """One streamed choice: deltas of reasoning, content and tool calls as the text grows.
    Content that may begin a tool call is held back until it is a call or surely not."""

    def __init__(self, reply: _Reply) -> None:
        self.reply = reply
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_calls = 0
        self.calls: list[ToolCall] = []   # the calls sent so far

    def add(self, text: str, finish_reason: str | None) -> list[tuple[dict, str | None]]:
        self.text += text
        finished = finish_reason is not None
        reasoning, content = self.reply.split(self.text)
        parser = self.reply.tools
        calls: list[ToolCall] = []
        if parser is not None:
            if finished:
                parsed, calls = parser.parse(content)
                visible = (parsed or "") if calls else content
            else:
                # (trailing whitespace waits: before a call it is not content)
                visible = content[:parser.content_end(content)].rstrip()
                calls = parser.complete_calls(content)
        else:
            visible = content
        deltas: list[dict] = []
        if reasoning and len(reasoning) > self.sent_reasoning:
            deltas.append({"reasoning_content": reasoning[self.sent_reasoning:]})
            self.sent_reasoning = len(reasoning)
        if len(visible) > self.sent_content:
            deltas.append({"content": visible[self.sent_content:]})
            self.sent_content = len(visible)
        self.calls += calls[self.sent_calls:]
        for i, call in enumerate(calls[self.sent_calls:], start=self.sent_calls):
            deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        self.sent_calls = max(self.sent_calls, len(calls))
        if finished:
            if self.sent_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            return [(d, None) for d in deltas] + [({}, finish_reason)]
        return [(d, None) for d in deltas]


def _constraint_param(req: CompletionRequest | ChatCompletionRequest) -> str:
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def _choices(finals: list[RequestOutput], n: int) -> list[tuple[int, CompletionOutput]]:
    """The first n completions of every prompt with their choice index (prompt i, sample j
    -> i*n+j); beam search may hold more hypotheses (best_of), best first."""
    return [(i * n + c.index, c) for i, out in enumerate(finals) for c in out.outputs[:n]]


def _usage(finals: list[RequestOutput], n: int, counts_generated: bool = True) -> dict:
    """Prompt tokens of every prompt (once, whatever n) and the tokens of every choice
    (none where the generated token is not returned: echo with max_tokens 0)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = (sum(len(c.token_ids) for _, c in _choices(finals, n))
                  if counts_generated else 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _raise_on_error(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(500, f"the engine failed on this request: {out.error}")


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), headers={"Retry-After": "5"})
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"{type(e).__name__}: {e}")


async def _collect(streams: list[AsyncIterator[RequestOutput]], raw: Request
                   ) -> list[RequestOutput]:
    """The final output of every request; aborts them all if the client goes away."""
    async def run() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            _raise_on_error(out)
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(streams))]

    task = asyncio.create_task(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "the client closed the request")
        return task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise
    except Exception as e:  # noqa: BLE001 - mapped to its HTTP status
        task.cancel()
        raise _engine_error(e) from None


def _event_stream(events: AsyncIterator[str], done: bool = True,
                  error: Callable[[APIError], str] | None = None) -> StreamingResponse:
    """Server-sent events; an error after the headers went out is reported in the stream
    (as `error` writes it, by default OpenAI's error body), then [DONE] where the API has it."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as e:  # noqa: BLE001 - the headers are sent: report in the stream
            err = _engine_error(e)
            yield error(err) if error is not None else sse(error_body(err.status, err.message,
                                                                      err.param))
        finally:
            await events.aclose()  # aborts whatever still runs (e.g. the client went away)
        if done:
            yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
