"""What a runner measures and what a result row holds (the JSON schema of `pagedllm bench`)."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Protocol

from pagedllm.bench.workloads import Workload

SCHEMA = "pagedllm-bench/1"


@dataclass
class ThroughputRun:
    """One timed pass over a workload."""

    elapsed_s: float
    output_lens: list[int]             # tokens each request actually produced, in workload order
    settings: dict = field(default_factory=dict)


@dataclass
class LatencyRun:
    """Timed single-request passes (one per iteration)."""

    ttft_s: list[float]                # time to first token of each iteration
    decode_tok_s: list[float]          # (output_len - 1) / (last token time - first token time)
    output_lens: list[int]             # tokens produced by each iteration
    settings: dict = field(default_factory=dict)


class Runner(Protocol):
    """An engine the bench can drive: ours, HF transformers, a llama.cpp server."""

    engine: str
    dtype: str
    threads: int

    def versions(self) -> dict[str, str]: ...
    def settings(self) -> dict: ...
    def warmup(self, workload: Workload) -> None: ...
    def throughput(self, workload: Workload) -> ThroughputRun: ...
    def latency(self, workload: Workload, iters: int) -> LatencyRun: ...
    def close(self) -> None: ...


@dataclass
class BenchResult:
    """One row: an engine in one dtype on one workload."""

    workload: str
    engine: str
    dtype: str
    threads: int
    versions: dict[str, str]
    settings: dict
    num_requests: int
    prompt_tokens: int
    requested_output_tokens: int
    output_tokens: int                  # counted from what the engine returned
    exact_output_lens: bool             # every request produced exactly its requested length
    elapsed_s: float | None = None
    output_tok_s: float | None = None
    total_tok_s: float | None = None
    req_s: float | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    roofline: dict | None = None
    roofline_fraction: float | None = None
    serial_fraction: float | None = None  # of the serial bound (see roofline.py)
    serving: dict | None = None         # TTFT/TPOT/ITL/E2E percentiles of `bench serve`
    notes: str = ""
    device: str = "cpu"                 # where the engine computed: cpu or cuda

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def label(self) -> str:
        extra = self.settings.get("label")
        return f"{self.engine} {self.dtype}" + (f" ({extra})" if extra else "")


@dataclass
class SpecRow:
    """One row of `bench spec`: a workload at a number of streams under one speculation
    setting (median seconds over the rounds; draft counts of the last round)."""

    workload: str
    streams: int
    speculation: str
    seconds: float
    runs_s: list[float]
    output_tokens: int
    tok_s: float
    speedup: float | None = None            # vs speculation off, same workload and streams
    # decoding only (spec.decode_seconds: from each request's first token on), median round
    decode_s: float | None = None
    decode_tok_s: float | None = None
    decode_speedup: float | None = None     # decode tok/s vs speculation off's
    same_tokens_as_off: bool | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    draft_seconds: float | None = None      # in a draft model's propose() (median round)
    per_request: list[dict] = field(default_factory=list)
    engine: str = "pagedllm"                # or "llama.cpp" (its speedup: vs its own "off")
    vs_pagedllm_off: dict | None = None     # a peer's greedy tokens vs pagedllm's "off"

    def to_dict(self) -> dict:
        return asdict(self)


def throughput_result(workload: Workload, run: ThroughputRun, runner: Runner) -> BenchResult:
    requested = [r.output_len for r in workload.requests]
    out = sum(run.output_lens)
    prompt = workload.num_prompt_tokens
    return BenchResult(
        workload=workload.name, engine=runner.engine, dtype=runner.dtype, threads=runner.threads,
        versions=runner.versions(), settings={**runner.settings(), **run.settings},
        num_requests=len(workload.requests), prompt_tokens=prompt,
        requested_output_tokens=sum(requested), output_tokens=out,
        exact_output_lens=run.output_lens == requested, elapsed_s=run.elapsed_s,
        output_tok_s=out / run.elapsed_s, total_tok_s=(prompt + out) / run.elapsed_s,
        req_s=len(workload.requests) / run.elapsed_s, device=_device(runner))


def latency_result(workload: Workload, run: LatencyRun, runner: Runner) -> BenchResult:
    requested = workload.requests[0].output_len
    return BenchResult(
        workload=workload.name, engine=runner.engine, dtype=runner.dtype, threads=runner.threads,
        versions=runner.versions(),
        settings={**runner.settings(), **run.settings, "iterations": len(run.ttft_s),
                  "ttft_s_all": run.ttft_s, "decode_tok_s_all": run.decode_tok_s},
        num_requests=1, prompt_tokens=workload.requests[0].prompt_len,
        requested_output_tokens=requested, output_tokens=run.output_lens[-1],
        exact_output_lens=all(n == requested for n in run.output_lens),
        ttft_s=statistics.median(run.ttft_s), decode_tok_s=statistics.median(run.decode_tok_s),
        device=_device(runner))


def pooled(runs: list[LatencyRun]) -> LatencyRun:
    """Several LatencyRuns of one engine as one (their iterations in order)."""
    return LatencyRun([t for r in runs for t in r.ttft_s], [d for r in runs for d in r.decode_tok_s],
                      [n for r in runs for n in r.output_lens], dict(runs[0].settings))


def _device(runner: Runner) -> str:
    """The runner's device; peers that run only on the CPU (llama.cpp) name none."""
    return getattr(runner, "device", "cpu")
