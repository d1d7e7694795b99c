"""Turning a request's cumulative outputs into stream deltas, and server-sent events."""
from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import Any, AsyncIterator

from pagedllm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import SamplingParams


class DeltaTracker:
    """What is new in each output of one completion (one choice).

    With stop strings, the last (longest stop - 1) characters are held back until the next
    token or the end: if a stop string completes later, the engine cuts it from the text,
    and what was already streamed must never contain its beginning. So the concatenated
    deltas always equal the final text.
    """

    def __init__(self, sp: SamplingParams) -> None:
        self.holdback = max((len(s) for s in sp.stop_strs), default=1) - 1
        if sp.include_stop_str_in_output:
            self.holdback = 0
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    def delta(self, completion: CompletionOutput) -> tuple[str, list[TokenLogprobs]]:
        """(new text, logprobs of the new tokens) to send for this output."""
        finished = self.done = completion.finish_reason is not None
        end = len(completion.text) if finished else max(
            self.sent_chars, len(completion.text) - self.holdback)
        text = completion.text[self.sent_chars:end]
        self.sent_chars = end
        logprobs = (completion.logprobs or [])[self.sent_tokens:]
        self.sent_tokens = len(completion.token_ids)
        return text, logprobs


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event: data (JSON unless a string), named where the API names them."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {payload}\n\n"


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with their index.

    If the consumer stops, every still-running request is cancelled (and so aborted).
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
