"""The FastAPI app: OpenAI-compatible endpoints, the job API, metrics, the KV-cache page."""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.anthropic import (MessagesRequest, anthropic_error,
                                                   create_message)
from pagedllm.entrypoints.openai.errors import (APIError, error_body, error_response,
                                                validation_error)
from pagedllm.entrypoints.openai.jobs import JobStore
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, EmbeddingRequest,
                                                  GenerateRequest, TokenizeRequest)
from pagedllm.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
from pagedllm.entrypoints.openai.responses import ResponsesRequest, create_response
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS

logger = logging.getLogger(__name__)

# Paths anyone may reach when --api-key is set: the health check, and the page's static HTML
# (it holds no data; everything it shows comes from /kv_cache and /v1, which need the key).
OPEN_PATHS = ("/health", "/", "/favicon.ico")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    max_waiting_requests: int = 256
    # After the engine dies the process exits (code 1) so that a supervisor restarts it, as
    # vLLM does; with this set it stays up answering 503 (and /health 503) instead.
    keep_alive_on_engine_death: bool = False
    tool_call_parser: str | None = None    # tool_parsers.PARSERS; None: from the template
    reasoning_parser: str | None = None    # reasoning.PARSERS; None: no split
    pooling: str = "last"                  # /v1/embeddings: last token or mean


class BodySizeLimit:
    """413 for bodies over the limit, refused before the body is read or parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # No length (chunked): read at most the limit first, then replay it to the app.
        body, message = b"", {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._refuse(send)
        replayed: Message = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay([replayed], receive), send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(413, self._message())).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class ApiKeyAuth:
    """401 unless `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) matches,
    compared in constant time, as vLLM does."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
        if not (bearer or key):
            err = error_response(APIError(
                401, "invalid or missing API key (send Authorization: Bearer <key>)"))
            return await err(scope, receive, send)
        await self.app(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()
    return replay


def _page() -> str:
    return resources.files("pagedllm.entrypoints.webui").joinpath("index.html").read_text()


def create_app(engine: AsyncLLM, config: ServerConfig, model_name: str) -> ASGIApp:
    metrics = ServerMetrics()
    engine.step_observers.append(metrics.observe_step)
    engine.abort_observers.append(metrics.forget)
    serving = OpenAIServing(
        engine, model_name,
        TOOL_PARSERS[config.tool_call_parser]() if config.tool_call_parser else None,
        REASONING_PARSERS[config.reasoning_parser]() if config.reasoning_parser else None,
        config.pooling)
    jobs = JobStore(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.is_alive:
            engine.start()
        yield
        await jobs.shutdown()
        engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None)

    def respond(request: Request, err: APIError) -> JSONResponse:
        if request.url.path == "/v1/messages":  # Anthropic's clients read their own shape
            return JSONResponse(anthropic_error(err), status_code=err.status, headers=err.headers)
        return error_response(err)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError) -> JSONResponse:
        return respond(request, err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(list(err.errors())))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, err: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(err), headers={"Retry-After": "5"}))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "pagedllm",
                                            "max_model_len": engine.engine.config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.chat(req, raw)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request) -> Any:
        return await create_message(serving, req, raw)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Any:
        return await create_response(serving, req, raw)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> dict:
        return await serving.embeddings(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        return serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        return serving.detokenize(req)

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> dict:
        try:
            sp = req.sampling_params()
            token_ids = engine.prepare(req.prompt, sp)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        serving._check_capacity(1)
        return jobs.submit(token_ids, sp).as_dict()

    @app.get("/result/{job_id}")
    async def result(job_id: str) -> dict:
        job = jobs.jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no job with id {job_id!r}", "job_id")
        return job.as_dict()

    @app.delete("/result/{job_id}")
    async def cancel(job_id: str) -> dict:
        job = jobs.abort(job_id)
        if job is None:
            raise APIError(404, f"no job with id {job_id!r}", "job_id")
        return job.as_dict()

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await engine.call(engine.engine.stats)
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/kv_cache")
    async def kv_cache() -> dict:
        snapshot = await engine.call(engine.engine.kv_cache_snapshot)
        return dataclasses.asdict(snapshot)

    @app.get("/favicon.ico")
    async def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return _page()

    guarded: ASGIApp = BodySizeLimit(app, config.max_body_bytes)
    if config.api_key is not None:
        guarded = ApiKeyAuth(guarded, config.api_key)
    return guarded  # type: ignore[return-value]


def bind_socket(config: ServerConfig) -> socket.socket:
    """The server's socket, bound before the engine starts: a port in use fails at once,
    not after the model has loaded, and nothing the engine opens meanwhile (the
    tensor-parallel rendezvous, gloo's connections on ephemeral ports) can take the port."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from e
    return sock


def run_server(engine: AsyncLLM, config: ServerConfig, model_name: str,
               sock: socket.socket | None = None) -> int:
    """Serve (on sock, if bound already) until stopped; the exit code: 1 if the engine
    died, else 0."""
    import uvicorn
    app = create_app(engine, config, model_name)
    # Idle keep-alive connections are closed after 10 s, not uvicorn's 5: httpx (and so the
    # openai client) drops idle pooled connections after 5 s, and with equal timeouts a
    # request sent just as the server closes its connection fails with a ReadError
    # (reproduced: 15 of 600 requests sent 4.95-5.05 s after the last one).
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=10))
    if not config.keep_alive_on_engine_death:
        def on_death(error: BaseException) -> None:
            logger.error("the engine died (%r): the server stops, so that whatever supervises "
                         "it can start it again (--keep-alive-on-engine-death keeps it up, "
                         "answering 503)", error)
            server.should_exit = True  # uvicorn polls it; open requests get their errors first
        engine.on_death = on_death
    logger.info("serving %s on http://%s:%d (page at /, OpenAI API at /v1)", model_name,
                config.host, config.port)
    server.run(sockets=[sock] if sock is not None else None)
    return 1 if engine.crashed else 0
