"""Logging: the engine says what it is doing on stderr (level from PAGEDLLM_LOGGING_LEVEL)."""
from __future__ import annotations

import logging
import os


def init_logging() -> None:
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
