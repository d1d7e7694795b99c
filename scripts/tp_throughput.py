"""Offline throughput (the W1 workload) at several tensor-parallel sizes, side by side.

W1: 64 requests, prompt lengths uniform in [32, 512], output lengths uniform in [32, 256],
ignore_eos, random token ids (seeded). Each size runs in its own process so that thread
settings and worker processes do not leak between runs. Prints a table and writes JSON.

  .venv/bin/python scripts/tp_throughput.py --model DIR_OR_GGUF --tp 1 2 [--num-prompts 64]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))],
             rng.randint(32, 256)) for _ in range(n)]


def run_one(model: str | None, tp: int, n: int, seed: int, dtype: str,
            num_threads: int | None) -> dict:
    from pagedllm import LLM, SamplingParams
    with LLM(model, dtype=dtype, tensor_parallel_size=tp, max_model_len=1024,
             num_threads=num_threads) as llm:
        requests = workload(n, seed, llm.engine.model_config.vocab_size)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                  for _, m in requests]
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params, use_tqdm=True)
        seconds = time.perf_counter() - t
    prompt = sum(len(p) for p, _ in requests)
    output = sum(len(o.token_ids) for o in outs)
    return {"tp": tp, "num_threads": num_threads, "seconds": seconds,
            "prompt_tokens": prompt, "output_tokens": output,
            "output_tok_s": output / seconds, "total_tok_s": (prompt + output) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="threads per rank (default: the cores divided among the ranks)")
    ap.add_argument("--json", default="tp_throughput.json")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT", json.dumps(run_one(args.model, args.one, args.num_prompts, args.seed,
                                           args.dtype, args.num_threads)), flush=True)
        return
    results = []
    for tp in args.tp:
        cmd = [sys.executable, __file__, "--one", str(tp), "--num-prompts",
               str(args.num_prompts), "--seed", str(args.seed), "--dtype", args.dtype]
        if args.model:
            cmd += ["--model", args.model]
        if args.num_threads:
            cmd += ["--num-threads", str(args.num_threads)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
        results.append(json.loads(out.split("RESULT", 1)[1]))
    print(f"{'tp':>3} {'seconds':>9} {'out tok/s':>10} {'total tok/s':>12}")
    for r in results:
        print(f"{r['tp']:>3} {r['seconds']:>9.1f} {r['output_tok_s']:>10.1f} "
              f"{r['total_tok_s']:>12.1f}")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
