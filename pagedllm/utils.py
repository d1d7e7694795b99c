"""Small helpers shared across pagedllm."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (positive b)."""
    return -(-a // b)
