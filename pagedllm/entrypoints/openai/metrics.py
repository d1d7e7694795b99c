"""Prometheus metrics of the server: engine gauges read at scrape time, latencies per token."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.stats import EngineStats, StepStats
from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """One registry per server, fed by the engine thread after every step."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "pagedllm"
        self.running = Gauge(f"{p}_num_requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge(f"{p}_num_requests_waiting", "requests waiting to be scheduled", registry=r)
        self.blocks_total = Gauge(f"{p}_kv_blocks_total", "physical KV-cache blocks", registry=r)
        self.blocks_used = Gauge(f"{p}_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.blocks_free = Gauge(f"{p}_kv_blocks_free", "KV blocks not held by any request", registry=r)
        self.blocks_cached = Gauge(f"{p}_kv_blocks_cached_free",
                                   "free KV blocks that still hold a reusable prefix", registry=r)
        self.hit_rate = Gauge(f"{p}_prefix_cache_hit_rate",
                              "share of looked-up prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Gauge(f"{p}_num_preemptions", "preemptions since start", registry=r)
        self.drafts = Gauge(f"{p}_spec_decode_num_drafts",
                            "speculative drafts (rows verifying draft tokens) since start",
                            registry=r)
        self.draft_tokens = Gauge(f"{p}_spec_decode_num_draft_tokens",
                                  "speculative draft tokens verified since start", registry=r)
        self.accepted_tokens = Gauge(f"{p}_spec_decode_num_accepted_tokens",
                                     "speculative draft tokens accepted since start", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "generated tokens", registry=r)
        self.requests_finished = Counter(f"{p}_requests_finished", "finished requests",
                                         ["finish_reason"], registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "time between two tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(f"{p}_step_batch_size", "sequences per engine step",
                                    ["kind"], buckets=_BATCH_BUCKETS, registry=r)
        self._last_token_time: dict[str, float] = {}
        self._num_tokens: dict[str, int] = {}

    def observe_step(self, step: StepStats, outputs: list[RequestOutput], now: float) -> None:
        """Called on the engine thread after each step."""
        if outputs:
            self.batch_size.labels("prefill" if step.is_prefill else "decode").observe(len(outputs))
        for out in outputs:
            rid = out.request_id
            num_tokens = sum(len(c.token_ids) for c in out.outputs)  # all n samples
            seen = self._num_tokens.get(rid)
            if seen is None:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(max(0.0, now - out.metrics.arrival_time))
                seen = 0
            else:
                self.itl.observe(now - self._last_token_time[rid])
            self.generation_tokens.inc(max(0, num_tokens - seen))
            if out.finished:
                self._num_tokens.pop(rid, None)
                self._last_token_time.pop(rid, None)
                self.requests_finished.labels(out.finish_reason or "unknown").inc()
            else:
                self._num_tokens[rid] = num_tokens
                self._last_token_time[rid] = now

    def forget(self, request_id: str) -> None:
        self._num_tokens.pop(request_id, None)
        self._last_token_time.pop(request_id, None)

    def render(self, stats: EngineStats) -> bytes:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_total.set(stats.num_blocks)
        self.blocks_used.set(stats.num_used_blocks)
        self.blocks_free.set(stats.num_free_blocks)
        self.blocks_cached.set(stats.num_cached_free_blocks)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.set(stats.num_preemptions)
        self.drafts.set(stats.num_drafts)
        self.draft_tokens.set(stats.num_draft_tokens)
        self.accepted_tokens.set(stats.num_accepted_tokens)
        return generate_latest(self.registry)
