"""The entry point of tensor-parallel ranks 1..N-1: build the model shard, then run the
steps rank 0 publishes until it says EXIT."""
from __future__ import annotations

import logging
import os
import signal

import torch

from pagedllm.attention.context import reset_context, set_context
from pagedllm.config import EngineConfig
from pagedllm.distributed import DistInfo, destroy_distributed
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.tp.processes import die_with_parent
from pagedllm.engine.tp.protocol import BlockMoves, acknowledge_exit
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
    serve_steps(runner)
    logger.debug("rank %d: exit", info.rank)


def serve_worker_rank(config: EngineConfig, info: DistInfo) -> None:
    """A rank > 0 started by torchrun: serve rank 0 until it exits, then leave the process
    (the rest of the user's script is rank 0's business)."""
    logger.info("rank %d of %d: serving tensor-parallel steps for rank 0 at %s:%d", info.rank,
                info.world_size, info.master_addr, info.master_port)
    worker_main(config, info, parent_pid=None)
    raise SystemExit(0)


@torch.inference_mode()
def serve_steps(runner: ModelRunner) -> None:
    """Run every step rank 0 publishes on this rank's shard until it says EXIT."""
    try:
        while (step := runner.channel.receive()) is not None:
            if isinstance(step, BlockMoves):
                runner.move_blocks_here(step)
                continue
            set_context(**vars(step.context))
            try:
                runner.execute_model(step.input_ids, step.positions, step.logit_rows,
                                     torch.empty(0, dtype=torch.int64) if step.full_forward else None)
            finally:
                reset_context()
        acknowledge_exit(runner.channel.store, runner.rank)
    except Exception as e:
        logger.error("rank %d: lost the tensor-parallel group (%s: %s); exiting",
                     runner.rank, type(e).__name__, e)
        raise SystemExit(1) from None
    finally:
        destroy_distributed()
