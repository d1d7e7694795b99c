"""Drive pagedllm itself: LLM.generate for throughput, LLMEngine.step for latency."""
from __future__ import annotations

import gc
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from pagedllm.bench.hardware import synchronize
from pagedllm.bench.results import LatencyRun, ThroughputRun
from pagedllm.bench.workloads import BenchRequest, Workload
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


# --structured-output json: a JSON schema no output of a benchmark's length completes (an
# array of at least 10000 digits), so that constrained requests still run exactly
# output_len tokens and the mask's cost per token is what differs.
BENCH_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 10000}


def exact_params(r: BenchRequest, structured: str = "none") -> SamplingParams:
    """Greedy, EOS ignored, exactly ``output_len`` tokens (under BENCH_SCHEMA with
    structured "json")."""
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA) if structured == "json" else None
    return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                          structured_outputs=constraint)


def pagedllm_version() -> str:
    """Package version plus the git commit when run from a checkout (benchmarks need both)."""
    try:
        v = version("pagedllm")
    except PackageNotFoundError:
        import pagedllm
        v = pagedllm.__version__
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return f"{v}+g{commit}{'.dirty' if dirty else ''}" if commit else v


class PagedLLMRunner:
    engine = "pagedllm"

    def __init__(self, model: str | None, dtype: str, threads: int,
                 engine_kwargs: dict[str, Any], structured: str = "none",
                 engine_dtype: str | None = None, label: str = "") -> None:
        """dtype names the run; the engine gets engine_dtype where given ("auto": as a user
        who names no dtype, whose GGUF weights then stay quantized where kernels exist).
        label tells this run's rows from another run of the same engine (e.g. "eager")."""
        from pagedllm.llm import LLM
        self.dtype, self.threads, self.label = dtype, threads, label
        self.structured = structured
        self.engine_kwargs = {**engine_kwargs, "dtype": engine_dtype or dtype, "num_threads": threads}
        t = time.perf_counter()
        self.llm = LLM(model, **self.engine_kwargs)
        self.load_s = time.perf_counter() - t
        self.device = self.llm.engine.config.device
        self._ids = 0

    def versions(self) -> dict[str, str]:
        return {"pagedllm": pagedllm_version(), "torch": torch.__version__}

    def executor(self) -> str:
        """What runs a decode step: CUDA graphs, the one-call CPU decode stack, or the
        model's forward op by op: "eager" when enforce_eager asked for it, "model forward"
        when neither executor applies (e.g. a float32 CPU model, a CUDA backend without
        graphs)."""
        runner = self.llm.engine.model_runner
        if getattr(runner, "graphs", None) is not None:
            return "cuda graphs"
        if getattr(runner, "decode_stack", None) is not None:
            return "cpu decode stack"
        return "eager" if self.llm.engine.config.enforce_eager else "model forward"

    def settings(self) -> dict:
        from pagedllm.loader.model_loader import decode_read_bytes
        cfg = self.llm.engine.config
        runner = self.llm.engine.model_runner
        labels = [self.label] if self.label else []
        if cfg.quantization == "gguf":
            labels.append("GGUF weights kept quantized")
        return {"device": cfg.device, "executor": self.executor(),
                "attention_backend": getattr(runner, "attention_backend", None),
                "max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "block_size": cfg.block_size, "kv_cache_dtype": cfg.kv_cache_dtype,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "enforce_eager": cfg.enforce_eager, "quantization": cfg.quantization,
                "num_kv_blocks": self.llm.engine.model_runner.num_kvcache_blocks,
                "load_s": round(self.load_s, 2), "structured_output": self.structured,
                **({"label": ", ".join(labels)} if labels else {}),
                # every expert's, as llama-bench's file size: the roofline takes a token's share
                **({"weight_bytes": decode_read_bytes(runner.model, every_expert=True)}
                   if cfg.quantization == "gguf" else {})}

    def warmup(self, workload: Workload) -> None:
        self.llm.generate([r.prompt_token_ids for r in workload.requests],
                          [exact_params(r, self.structured) for r in workload.requests], use_tqdm=False)

    def throughput(self, workload: Workload) -> ThroughputRun:
        prompts = [r.prompt_token_ids for r in workload.requests]
        params = [exact_params(r, self.structured) for r in workload.requests]
        engine = self.llm.engine
        prompt_before, gen_before = engine.num_prompt_tokens, engine.num_generation_tokens
        synchronize(self.device)
        t = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=True)
        synchronize(self.device)
        elapsed = time.perf_counter() - t
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise RuntimeError(f"pagedllm failed {len(errors)} requests: {errors[0]}")
        return ThroughputRun(elapsed, [len(o.token_ids) for o in outputs], {
            "computed_prompt_tokens": engine.num_prompt_tokens - prompt_before,
            "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outputs),
            "engine_generated_tokens": engine.num_generation_tokens - gen_before})

    def latency(self, workload: Workload, iters: int) -> LatencyRun:
        r = workload.requests[0]
        ttfts, rates, lens = [], [], []
        for _ in range(iters):
            self.llm.reset_prefix_cache()  # each time to first token computes the whole prompt
            ttft, rate, n = self._one_stream(r)
            ttfts.append(ttft)
            rates.append(rate)
            lens.append(n)
        return LatencyRun(ttfts, rates, lens)

    def _one_stream(self, r: BenchRequest) -> tuple[float, float, int]:
        """One request alone through LLMEngine.step: TTFT and decode tokens/s."""
        engine = self.llm.engine
        request_id = f"bench-latency-{self._ids}"
        self._ids += 1
        synchronize(self.device)
        start = time.perf_counter()
        engine.add_request(request_id, r.prompt_token_ids, exact_params(r, self.structured))
        first = last = None
        while True:
            outputs = engine.step()
            now = time.perf_counter()
            out = next((o for o in outputs if o.request_id == request_id), None)
            if out is None:
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the latency request vanished from the engine")
                continue
            if out.error:
                raise RuntimeError(f"pagedllm failed the latency request: {out.error}")
            first = first if first is not None else now
            last = now
            if out.finished:
                n = len(out.token_ids)
                decode = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
                return first - start, decode, n

    def close(self) -> None:
        """Free the engine entirely (weights, KV cache, CUDA graphs' pool) before the next
        one loads: the next engine's KV budget is a fraction of the memory free then."""
        self.llm.shutdown()
        del self.llm
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
