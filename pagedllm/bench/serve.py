"""`pagedllm bench serve`: Poisson arrivals against an OpenAI-compatible /v1/completions.

The metrics are those of vLLM's serving benchmark: time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency between streamed chunks (ITL) and
end-to-end latency (E2EL), at mean / p50 / p90 / p99, plus request and token throughput.
Prompts are token ids (exact lengths) or their text; EOS is ignored (vLLM's `ignore_eos`
extension) and `stream_options.include_usage` gives the exact count of generated tokens.
"""
from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pagedllm.bench.http_client import HTTPError, request_json, stream_events
from pagedllm.bench.results import BenchResult
from pagedllm.bench.workloads import BenchRequest, Workload
from pagedllm.tokenizer import Tokenizer


@dataclass
class RequestTrace:
    """What the client saw of one streamed request."""

    prompt_len: int
    requested: int
    start: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of ``rate``."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps)[:-1]]).tolist()


def served_model(base_url: str) -> str:
    models = request_json("GET", f"{base_url}/v1/models", timeout=30)
    data = models.get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return data[0]["id"]


def send_one(base_url: str, model: str, prompt: Any, r: BenchRequest) -> RequestTrace:
    trace = RequestTrace(r.prompt_len, r.output_len)
    body = {"model": model, "prompt": prompt, "max_tokens": r.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    trace.start = last = time.perf_counter()
    chunks = 0
    try:
        for now, event in stream_events(f"{base_url}/v1/completions", body):
            if event.get("choices"):
                if chunks == 0:
                    trace.ttft = now - trace.start
                else:
                    trace.itl.append(now - last)
                last = now
                chunks += 1
            if event.get("usage"):
                trace.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                trace.prompt_len = int(event["usage"].get("prompt_tokens") or trace.prompt_len)
                trace.usage_reported = True
        trace.latency = time.perf_counter() - trace.start
        if not trace.usage_reported:
            trace.output_tokens = chunks  # one token per chunk: a fair guess without usage
        if chunks == 0:
            trace.error = "the stream carried no tokens"
    except (OSError, HTTPError, ValueError) as e:
        trace.error = f"{type(e).__name__}: {e}"
    return trace


def run_requests(base_url: str, model: str, prompts: list[Any], reqs: list[BenchRequest],
                 rate: float, max_concurrency: int | None, seed: int) -> tuple[list[RequestTrace], float]:
    """Send each request at its arrival time, each in its own thread; wait for all."""
    traces: list[RequestTrace | None] = [None] * len(reqs)
    limit = threading.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(reqs), desc=f"serve @ {rate} req/s", dynamic_ncols=True, leave=False)

    def work(i: int) -> None:
        if limit:
            limit.acquire()
        try:
            traces[i] = send_one(base_url, model, prompts[i], reqs[i])
        finally:
            if limit:
                limit.release()
            bar.update(1)

    threads = []
    t0 = time.perf_counter()
    for i, offset in enumerate(arrival_offsets(len(reqs), rate, seed)):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=work, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    duration = time.perf_counter() - t0
    bar.close()
    return [t for t in traces if t is not None], duration


def _stats(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None when there is nothing to summarise)."""
    if not values:
        return {k: None for k in ("mean", "p50", "p90", "p99")}
    ms = np.asarray(values) * 1000
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def serving_metrics(traces: list[RequestTrace], duration: float) -> dict[str, Any]:
    ok = [t for t in traces if t.error is None]
    out_tokens = sum(t.output_tokens for t in ok)
    prompt_tokens = sum(t.prompt_len for t in ok)
    tpot = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(traces) - len(ok),
        "errors": sorted({t.error for t in traces if t.error})[:5],
        "duration_s": duration, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (prompt_tokens + out_tokens) / duration,
        "usage_reported": all(t.usage_reported for t in ok),
        "ttft": _stats([t.ttft for t in ok]), "tpot": _stats(tpot),
        "itl": _stats([x for t in ok for x in t.itl]), "e2el": _stats([t.latency for t in ok]),
    }


def _prompts(prompt_format: str, workload: Workload, tokenizer: Tokenizer) -> list[Any]:
    if prompt_format == "ids":
        return [r.prompt_token_ids for r in workload.requests]
    return [tokenizer.decode(r.prompt_token_ids) for r in workload.requests]


def _server_version(base_url: str) -> str:
    try:
        return str(request_json("GET", f"{base_url}/version", timeout=10).get("version", "unknown"))
    except (OSError, HTTPError, ValueError, AttributeError):
        return "unknown"


def run_serve(args: argparse.Namespace, workload: Workload,
              tokenizer: Tokenizer) -> tuple[BenchResult, list[str]]:
    """Drive the server at --base-url with the serve workload: its result row, and notes."""
    base_url = args.base_url.rstrip("/")
    model = args.served_model_name or served_model(base_url)
    prompts = _prompts(args.prompt_format, workload, tokenizer)
    traces, duration = run_requests(base_url, model, prompts, workload.requests,
                                    args.request_rate, args.max_concurrency, args.seed)
    metrics = serving_metrics(traces, duration)
    ok = [t for t in traces if t.error is None]
    exact = len(ok) == len(workload.requests) and all(t.output_tokens == t.requested for t in ok)
    dtype = ",".join(args.dtype) if args.dtype != ["auto"] else "server's"
    result = BenchResult(
        workload="serve", engine=f"http:{model}", dtype=dtype, threads=args.threads,
        versions={"server": _server_version(base_url)},
        settings={"base_url": base_url, "request_rate": args.request_rate,
                  "max_concurrency": args.max_concurrency, "prompt_format": args.prompt_format},
        num_requests=len(workload.requests), prompt_tokens=metrics["prompt_tokens"],
        requested_output_tokens=workload.num_output_tokens, output_tokens=metrics["output_tokens"],
        exact_output_lens=exact, elapsed_s=duration, output_tok_s=metrics["output_throughput"],
        total_tok_s=metrics["total_token_throughput"], req_s=metrics["request_throughput"],
        ttft_s=metrics["ttft"]["p50"] / 1000 if metrics["ttft"]["p50"] is not None else None,
        serving={**metrics, "base_url": base_url, "request_rate": args.request_rate},
        notes="" if args.prompt_format == "ids" else "text prompts: token counts from the server")
    failed = [f"{metrics['failed']} serve requests failed: {metrics['errors']}"] if metrics["failed"] else []
    return result, failed
