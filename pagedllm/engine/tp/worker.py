"""The entry point of tensor-parallel ranks 1..N-1: build the model shard, then run the
steps rank 0 publishes until it says EXIT."""
from __future__ import annotations

import logging
import os
import signal

from pagedllm.config import EngineConfig
from pagedllm.distributed import DistInfo
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.tp.processes import die_with_parent
from pagedllm.loader import load_model_source
from pagedllm.logger import init_logging

logger = logging.getLogger(__name__)


def worker_main(config: EngineConfig, info: DistInfo, parent_pid: int | None) -> None:
    """Entry point of ranks 1..N-1: build the model shard, then run steps until EXIT."""
    init_logging()
    if parent_pid is not None:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    source = load_model_source(config.model)
    runner = ModelRunner(config, source.config, source.weights(config.torch_dtype), info)
    runner.worker_loop()
    logger.debug("rank %d: exit", info.rank)


def serve_worker_rank(config: EngineConfig, info: DistInfo) -> None:
    """A rank > 0 started by torchrun: serve rank 0 until it exits, then leave the process
    (the rest of the user's script is rank 0's business)."""
    logger.info("rank %d of %d: serving tensor-parallel steps for rank 0 at %s:%d", info.rank,
                info.world_size, info.master_addr, info.master_port)
    worker_main(config, info, parent_pid=None)
    raise SystemExit(0)
