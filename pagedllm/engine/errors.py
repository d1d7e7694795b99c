"""Errors the engine raises when it can no longer serve."""
from __future__ import annotations

from pagedllm.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine stopped: its own state (scheduler, block accounting) can no longer be
    trusted, so every request it held ended with an error and it refuses new work.

    ``outputs`` are the final outputs (finish reason "error") of the requests that were in
    flight when it stopped, so a caller streaming them can tell each client why.
    """

    def __init__(self, message: str, outputs: list[RequestOutput] | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []
