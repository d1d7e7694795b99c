"""Measure what block sharing and moving buy (issue 5), on the bundled SmolLM2 (fp32).

  stream-gap  largest gap between two tokens of a running stream while a ~4,000-token
              prompt prefills: unchunked vs chunked prefill (budgets 2048 and 512)
  swap        the same preemption-forcing workload with preemption_mode recompute vs swap
  kv          KV-memory report (tokens held vs slots allocated) for a mixed workload

Timings on a shared machine are noisy: compare the figures of one run, side by side.
Usage: python scripts/sharing_figures.py [stream-gap|swap|kv ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time

from pagedllm import LLM, SamplingParams

BLOCK_BYTES_FP32 = 16 * 2 * 30 * 3 * 64 * 4   # SmolLM2, block_size 16


def long_prompt(llm: LLM, n_tokens: int) -> list[int]:
    text = ("In the beginning the engineers measured everything twice, because the machines "
            "were shared and the clocks were noisy. ")
    ids = llm.get_tokenizer().encode(text * (n_tokens // 15 + 1))
    return ids[:n_tokens]


def stream_gap(chunked: bool, budget: int | None, prompt_tokens: int = 4000) -> dict:
    """Start a stream, let it decode, then add a long prompt; time the stream's tokens."""
    kw = dict(max_num_batched_tokens=budget) if budget else {}
    llm = LLM(dtype="float32", max_model_len=8192, enable_chunked_prefill=chunked,
              kv_cache_memory_bytes=1 << 30, **kw)
    engine = llm.engine
    engine.add_request("stream", "Count slowly from one to one hundred:",
                       SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    times: list[float] = []
    while len(times) < 5:                       # the stream is running
        for out in engine.step():
            times.append(time.perf_counter())
    engine.add_request("long", long_prompt(llm, prompt_tokens),
                       SamplingParams(temperature=0, max_tokens=1))
    t_added = time.perf_counter()
    long_done = None
    while long_done is None:
        for out in engine.step():
            if out.request_id == "stream":
                times.append(time.perf_counter())
            elif out.finished:
                long_done = time.perf_counter()
    for out in engine.step():                   # one more stream token after it
        times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= t_added]
    engine.abort_request("stream")
    steady = [b - a for a, b in zip(times[:5], times[1:5])]
    return dict(chunked=chunked, budget=engine.scheduler.max_num_batched_tokens,
                prompt_tokens=prompt_tokens, max_gap_s=max(gaps),
                steady_gap_s=sorted(steady)[len(steady) // 2],
                long_prompt_latency_s=long_done - t_added, stream_tokens_during=len(gaps))


def swap_vs_recompute() -> list[dict]:
    results = []
    for mode in ("recompute", "swap"):
        rng = random.Random(0)  # the same prompts in both modes, so their outputs compare
        llm = LLM(dtype="float32", block_size=16, max_model_len=1024, preemption_mode=mode,
                  swap_space=0.25, kv_cache_memory_bytes=48 * BLOCK_BYTES_FP32)
        prompts = [long_prompt(llm, rng.randint(60, 120)) for _ in range(8)]
        sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t
        sched = llm.engine.scheduler
        results.append(dict(mode=mode, seconds=seconds, preemptions=sched.num_preemptions,
                            swap_outs=sched.num_swap_outs,
                            prompt_tokens_computed=llm.engine.num_prompt_tokens,
                            tokens=[o.token_ids for o in outs]))
    results[1]["same_outputs_as_recompute"] = results[0]["tokens"] == results[1]["tokens"]
    for r in results:
        del r["tokens"]
    return results


def kv_report() -> dict:
    llm = LLM(dtype="float32", block_size=16, max_model_len=2048, kv_cache_memory_bytes=1 << 30)
    rng = random.Random(1)
    prompts = [long_prompt(llm, rng.randint(20, 400)) for _ in range(24)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(32, 256),
                             ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.kv_stats
    return dict(report=llm.engine.kv_memory_report(), waste=stats.waste,
                tokens_held=stats.tokens_held, slots_allocated=stats.slots_allocated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="*", default=["stream-gap", "swap", "kv"])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    figures: dict = {}
    if "stream-gap" in args.what:
        figures["stream_gap"] = [stream_gap(False, None), stream_gap(True, 2048),
                                 stream_gap(True, 512)]
        print("\nlargest gap between tokens of a running stream while a 4000-token prompt prefills")
        print(f"{'mode':<22}{'max gap s':>10}{'steady s':>10}{'prompt s':>10}{'tokens':>8}")
        for r in figures["stream_gap"]:
            mode = f"chunked {r['budget']}" if r["chunked"] else "unchunked"
            print(f"{mode:<22}{r['max_gap_s']:>10.2f}{r['steady_gap_s']:>10.3f}"
                  f"{r['long_prompt_latency_s']:>10.2f}{r['stream_tokens_during']:>8}")
    if "swap" in args.what:
        figures["swap"] = swap_vs_recompute()
        print("\npreemption-forcing workload (8 prompts, 96 tokens each, 48 KV blocks)")
        for r in figures["swap"]:
            print(f"{r['mode']:<10} {r['seconds']:.2f} s, {r['preemptions']} preemptions, "
                  f"{r['swap_outs']} swap-outs, {r['prompt_tokens_computed']} prompt tokens computed")
        print("swap outputs equal recompute outputs:", figures["swap"][1]["same_outputs_as_recompute"])
    if "kv" in args.what:
        figures["kv"] = kv_report()
        print("\n" + figures["kv"]["report"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
