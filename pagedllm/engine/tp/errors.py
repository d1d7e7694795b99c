"""The error a broken tensor-parallel group raises."""
from __future__ import annotations


class TensorParallelError(RuntimeError):
    """A rank died, hung or failed mid-step: the process group is unusable."""
