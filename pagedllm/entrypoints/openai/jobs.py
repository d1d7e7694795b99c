"""The job API of seed 004 (vllmini): POST /generate returns an id at once, GET /result/{id}
returns the status and the text generated so far."""
from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.sampling_params import SamplingParams


@dataclass
class Job:
    id: str
    status: str = "queued"          # queued, running, finished, error
    text: str = ""
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {"id": self.id, "status": self.status, "text": self.text,
                "num_prompt_tokens": self.num_prompt_tokens, "num_tokens": self.num_tokens,
                "finish_reason": self.finish_reason, "error": self.error}


class JobStore:
    """Jobs run as background tasks; the newest `max_jobs` results are kept for polling."""

    def __init__(self, engine: AsyncLLM, max_jobs: int = 1000) -> None:
        self.engine = engine
        self.max_jobs = max_jobs
        self.jobs: OrderedDict[str, Job] = OrderedDict()

    def submit(self, token_ids: list[int], sp: SamplingParams) -> Job:
        job = Job(f"job-{uuid.uuid4().hex}", num_prompt_tokens=len(token_ids))
        self.jobs[job.id] = job
        while len(self.jobs) > self.max_jobs:
            _, old = self.jobs.popitem(last=False)
            if old.task is not None:
                old.task.cancel()
        job.task = asyncio.create_task(self._run(job, token_ids, sp))
        return job

    async def _run(self, job: Job, token_ids: list[int], sp: SamplingParams) -> None:
        try:
            async for out in self.engine.generate(None, sp, job.id, prompt_token_ids=token_ids):
                job.status = "running"
                job.text = out.text
                job.num_tokens = len(out.token_ids)
                if out.finished:
                    job.finish_reason = out.finish_reason
                    job.error = out.error
                    job.status = "error" if out.error else "finished"
        except asyncio.CancelledError:
            job.status = "aborted"
            raise
        except Exception as e:  # noqa: BLE001 - reported through GET /result
            job.status, job.error = "error", f"{type(e).__name__}: {e}"

    def abort(self, job_id: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is not None and job.task is not None and not job.task.done():
            job.task.cancel()
        return job

    async def shutdown(self) -> None:
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
