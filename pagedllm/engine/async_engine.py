"""AsyncLLM: the engine loop that runs beside the HTTP server (continuous batching).

The LLMEngine lives on one background thread, the engine thread, which loops: take the
commands that arrived (add, abort, call), run one step, hand each request's output to that
request's own asyncio queue. A request added while a step runs joins the batch at the next
step. Only the engine thread touches the scheduler and the block manager, so they need no
locks; the asyncio side talks to it through a command queue and reads back through
`loop.call_soon_threadsafe`. torch releases the GIL inside its ops, so the event loop keeps
serving HTTP while a forward pass runs. (Why a thread and not a process: README, Architecture.)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pagedllm.config import EngineConfig
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine, Prompt
from pagedllm.engine.stats import StepStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StepObserver = Callable[[StepStats, list[RequestOutput], float], None]


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


class _RequestStream:
    """Outputs of one request: filled from the engine thread, read by one coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    stream: _RequestStream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


class AsyncLLM:
    """Streams per request from one continuously batched engine.

    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"): ...
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.step_observers: list[StepObserver] = []
        self.abort_observers: list[Callable[[str], None]] = []
        self.dead_error: BaseException | None = None
        self.crashed = False  # the loop died of an error (not an orderly shutdown)
        # Called from the engine thread after a crash, once every caller has its error.
        self.on_death: Callable[[BaseException], None] | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _RequestStream] = {}   # engine thread only
        self._pending_adds = 0                            # submitted, not yet in the engine
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> "AsyncLLM":
        return cls(LLMEngine(config), **kwargs)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step; in-flight requests end with an error and
        tensor-parallel workers exit."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)
        if not self._thread.is_alive():  # never started, or done (then this is a no-op)
            self.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    # ---- the asyncio side ---------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the scheduler's queue or still on their way to it."""
        return self.engine.num_waiting + self._pending_adds

    def prepare(self, prompt: Prompt, sampling_params: SamplingParams) -> list[int]:
        """Tokenize and validate; raises ValueError naming the problem (e.g. too long)."""
        _, token_ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate_prompt(token_ids, sampling_params)
        return token_ids

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")

    async def generate(self, prompt: Prompt | list[int], sampling_params: SamplingParams,
                       request_id: str, arrival_time: float | None = None,
                       prompt_token_ids: list[int] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs as they come (the last has finished=True).

        If the consumer stops early (client disconnect, cancellation), the request is
        aborted and its blocks are freed before the engine's next step.
        """
        self._check_alive()
        token_ids = (prompt_token_ids if prompt_token_ids is not None
                     else self.prepare(prompt, sampling_params))
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting "
                                 f"(max_waiting_requests={self.max_waiting_requests})")
        stream = _RequestStream(asyncio.get_running_loop())
        with self._pending_lock:
            self._pending_adds += 1
        self._commands.put(_Add(request_id, token_ids, sampling_params,
                                arrival_time if arrival_time is not None else time.time(), stream))
        finished = False
        try:
            while True:
                item = await self._next(stream)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def _next(self, stream: _RequestStream) -> RequestOutput | BaseException:
        """The stream's next item; an error instead of waiting forever if the loop died."""
        while True:
            try:
                return await asyncio.wait_for(stream.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if not self.is_alive and stream.queue.empty():
                    return EngineDeadError(f"the engine stopped: {self.dead_error!r}")

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step starts."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps (a consistent view of engine state)."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("engine loop started")
        try:
            while self._handle_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
            error: BaseException = EngineDeadError("the engine was shut down")
            logger.info("engine loop stopped")
        except BaseException as e:  # noqa: BLE001 - whatever killed the loop is reported
            logger.exception("engine loop died")
            error = e
            self.crashed = True
        self._die(error)
        # The thread that ran the steps also stops the tensor-parallel workers (no-op at TP=1).
        self.engine.shutdown()
        if self.crashed and self.on_death is not None:
            self.on_death(error)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.time()
        if not outputs:
            time.sleep(0.001)  # nothing could be scheduled: do not spin
            return
        deliveries = []
        for out in outputs:
            stream = (self._streams.pop(out.request_id, None) if out.finished
                      else self._streams.get(out.request_id))
            if stream is not None:
                deliveries.append((stream, out))
        for stream, out in deliveries:
            stream.put_threadsafe(out)
        for observer in self.step_observers:
            observer(self.engine.last_step, outputs, now)

    def _handle_commands(self, block: bool) -> bool:
        """Apply every queued command; wait for one if the engine is idle. False = stop."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            if self.engine.abort_request(command.request_id) is not None:
                logger.info("aborted request %s", command.request_id)
                for observer in self.abort_observers:
                    observer(command.request_id)
        else:
            try:
                command.future.set_result(command.fn())
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                command.future.set_exception(e)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids,
                                    command.sampling_params, command.arrival_time)
            self._streams[command.request_id] = command.stream
        except ValueError as e:
            command.stream.put_threadsafe(e)
        except Exception as e:  # noqa: BLE001 - one request that cannot be added ends alone
            logger.exception("adding request %s failed", command.request_id)
            command.stream.put_threadsafe(ValueError(f"the request could not be added: "
                                                     f"{type(e).__name__}: {e}"))
        finally:
            with self._pending_lock:
                self._pending_adds -= 1

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"the engine stopped: {error!r}")
        for stream in self._streams.values():
            stream.put_threadsafe(dead)
        self._streams.clear()
        while True:  # fail whatever is still queued, so no caller waits forever
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                command.stream.put_threadsafe(dead)
            elif isinstance(command, _Call):
                command.future.set_exception(dead)
