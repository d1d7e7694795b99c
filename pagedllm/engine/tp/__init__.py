"""Tensor parallelism's processes and messages (seed 002): rank 0 schedules and samples,
ranks 1..N-1 run their shard of the model on the inputs rank 0 publishes for each step.

protocol.py: the step messages and their channel; processes.py: rank 0's view of the worker
processes, its place in the group, and the signal handling around a step; worker.py: the
entry point of ranks 1..N-1.
"""
