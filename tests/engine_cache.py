"""A bounded cache of engines for test modules that compare many configurations.

Loading an engine costs seconds, so modules keep the engines they reuse; but each holds its
weights (SmolLM2 in fp32: ~0.5 GB) and KV cache, and a module caching every configuration it
meets grew the test process past the machine's 24 GiB. This keeps the most recently used few
and shuts down the one it drops.
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Callable, Hashable

from pagedllm import LLM


def bounded_engine_cache(maxsize: int) -> Callable[[Callable[..., LLM]], Callable[..., LLM]]:
    def decorate(make: Callable[..., LLM]) -> Callable[..., LLM]:
        engines: OrderedDict[Hashable, LLM] = OrderedDict()

        def get(*args: Hashable, **kwargs: Hashable) -> LLM:
            key = (args, tuple(sorted(kwargs.items())))
            if key in engines:
                engines.move_to_end(key)
                return engines[key]
            while len(engines) >= maxsize:
                _, old = engines.popitem(last=False)
                old.shutdown()
                del old
                gc.collect()
            engines[key] = llm = make(*args, **kwargs)
            return llm

        return get
    return decorate
