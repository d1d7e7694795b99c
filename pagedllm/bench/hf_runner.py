"""The HF transformers peer: `generate` on the same token ids, static batches, left padding.

This is how vLLM's paper and benchmarks run HF: requests are cut into batches in workload
order, each batch is padded on the left to its longest prompt and generates as many tokens
as its longest request asks for. Only the requested tokens count, so the padding and the
over-generation are the cost of static batching. The best of a few batch sizes is kept.

On CUDA the model is moved to the GPU in the run's dtype and the clocks are read after
torch.cuda.synchronize(), so every timed kernel has finished.
"""
from __future__ import annotations

import gc
import os
import time

import torch
from tqdm.auto import tqdm

from pagedllm.bench.hardware import synchronize
from pagedllm.bench.results import LatencyRun, ThroughputRun
from pagedllm.bench.workloads import BenchRequest, Workload

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The same weights as pagedllm: a GGUF file (dequantized by transformers) or an HF dir."""
    from transformers import AutoModelForCausalLM
    if os.path.isfile(model_path):
        directory, name = os.path.split(os.path.abspath(model_path))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    # EOS ignored: generation never stops early; every row runs to max_new_tokens.
    model.generation_config.eos_token_id = None
    return model.eval()


class HFRunner:
    engine = "hf-transformers"

    def __init__(self, model_path: str, dtype: str, threads: int, batch_sizes: list[int],
                 device: str = "cpu") -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"HF transformers cannot run dtype {dtype!r}")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"HF batch sizes must be positive integers, got {batch_sizes}")
        self.dtype, self.threads, self.batch_sizes = dtype, threads, sorted(set(batch_sizes))
        self.device = device
        torch.set_num_threads(threads)
        t = time.perf_counter()
        self.model = load_hf_model(model_path, _DTYPES[dtype]).to(device)
        synchronize(device)
        self.load_s = time.perf_counter() - t
        self.pad_token_id = 0  # masked out by the attention mask; any valid id does

    def versions(self) -> dict[str, str]:
        import transformers
        return {"transformers": transformers.__version__, "torch": torch.__version__}

    def settings(self) -> dict:
        return {"batching": "static, padded left", "load_s": round(self.load_s, 2),
                "device": self.device,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}

    def warmup(self, workload: Workload) -> None:
        self._generate_batch(workload.requests)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[BenchRequest], streamer: object = None) -> list[int]:
        """Generate for one static batch; return the tokens produced for each request."""
        torch.set_num_threads(self.threads)
        ids, mask = left_padded(batch, self.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        width = ids.shape[1]
        max_new = max(r.output_len for r in batch)
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                  do_sample=False, pad_token_id=self.pad_token_id,
                                  streamer=streamer)
        produced = out.shape[1] - width
        if produced != max_new:
            raise RuntimeError(f"HF generate produced {produced} tokens, asked for {max_new} "
                               "(EOS was not ignored)")
        return [min(r.output_len, produced) for r in batch]

    def _run_batched(self, workload: Workload, batch_size: int) -> tuple[float, list[int]]:
        reqs = workload.requests
        batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
        lens: list[int] = []
        synchronize(self.device)
        t = time.perf_counter()
        for batch in tqdm(batches, desc=f"HF {self.dtype} batch {batch_size}", leave=False,
                          dynamic_ncols=True):
            lens.extend(self._generate_batch(batch))
        synchronize(self.device)
        return time.perf_counter() - t, lens

    def throughput(self, workload: Workload) -> ThroughputRun:
        """Run the whole workload at each batch size; keep the fastest."""
        tried: dict[int, float] = {}
        best: tuple[float, list[int], int] | None = None
        for bs in self.batch_sizes:
            if bs > len(workload.requests) and tried:
                continue  # the same as the whole workload in one batch, already tried
            elapsed, lens = self._run_batched(workload, bs)
            tried[bs] = round(sum(lens) / elapsed, 2)
            if best is None or elapsed < best[0]:
                best = (elapsed, lens, bs)
            gc.collect()
        assert best is not None
        return ThroughputRun(best[0], best[1], {"batch_size": best[2],
                                                "output_tok_s_by_batch_size": tried})

    def latency(self, workload: Workload, iters: int) -> LatencyRun:
        r = workload.requests[0]
        ttfts, rates, lens = [], [], []
        for _ in range(iters):
            streamer = _TimingStreamer(self.device)
            synchronize(self.device)
            start = time.perf_counter()
            n = self._generate_batch([r], streamer)[0]
            times = streamer.token_times
            ttfts.append(times[0] - start)
            rates.append((len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan"))
            lens.append(n)
        return LatencyRun(ttfts, rates, lens)

    def close(self) -> None:
        del self.model
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def left_padded(batch: list[BenchRequest], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of a static batch, each prompt padded on the left to
    the longest (the layout `generate` expects of a decoder-only model)."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        mask[i, width - r.prompt_len:] = 1
    return ids, mask


class _TimingStreamer:
    """A transformers streamer that only notes when each generated token arrives (on
    CUDA once the GPU has finished computing it)."""

    def __init__(self, device: str = "cpu") -> None:
        self.token_times: list[float] = []
        self.device = device
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:  # generate() first puts the prompt
            self._seen_prompt = True
            return
        synchronize(self.device)
        self.token_times.append(time.perf_counter())

    def end(self) -> None:
        pass
