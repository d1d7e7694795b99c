"""Single-stream speed with draft-model speculative decoding on the bundled SmolLM2:
plain decoding against self-speculation (the target's first N layers draft k tokens) for
a few N and k, and the target as its own draft (every draft accepted: the cost of a draft
as expensive as the target). Same code-editing prompt as spec_decode_figures.py, greedy;
the engines run alternately in one process and the median of the runs is kept. Besides
tok/s: the acceptance rate and the draft's cost per step (its propose() time per call,
which holds its catch-up pass and k - 1 decode passes) against a plain step.

Usage: python scripts/spec_decode_draft_figures.py [--tokens 128] [--runs 3]
       [--layers 4 8 15] [--k 2 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from spec_decode_figures import PROMPT

from pagedllm import LLM, SamplingParams
from pagedllm.loader import default_model_path


def engines(layers: list[int], ks: list[int]) -> dict[str, LLM]:
    options = dict(kv_cache_memory_bytes=256 * 2**20, max_model_len=2048)
    out = {"off": LLM(**options)}
    for n in layers:
        for k in ks:
            out[f"self N={n} k={k}"] = LLM(speculative_config={
                "method": "self", "num_draft_layers": n, "num_speculative_tokens": k}, **options)
    out["itself k=4"] = LLM(speculative_config={"model": str(default_model_path()),
                                                "num_speculative_tokens": 4}, **options)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="output tokens (EOS ignored)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 15])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    llms = engines(args.layers, args.k)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in llms}
    outputs = {}
    for name, llm in llms.items():  # warm-up: kernels, caches
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    draft_start = {name: _draft_stats(llm) for name, llm in llms.items()}
    for _ in range(args.runs):
        for name, llm in llms.items():
            t = time.perf_counter()
            outputs[name] = llm.generate([PROMPT], params, use_tqdm=False)[0]
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["off"])
    plain_step_ms = 1e3 * base / args.tokens
    print(f"{'speculation':<16}{'median s':>9}{'tok/s':>8}{'speedup':>9}{'accept':>8}"
          f"{'tok/step':>9}{'draft ms/step':>14}{'draft/plain step':>17}")
    rows = []
    for name, ts in times.items():
        m = outputs[name].metrics
        seconds = statistics.median(ts)
        calls, draft_s = _minus(_draft_stats(llms[name]), draft_start[name])
        draft_ms = 1e3 * draft_s / calls if calls else 0.0
        steps = calls / args.runs if calls else args.tokens
        row = {"speculation": name, "seconds": seconds, "runs": ts,
               "tokens_per_s": args.tokens / seconds, "speedup": base / seconds,
               "num_draft_tokens": m.num_draft_tokens,
               "num_accepted_tokens": m.num_accepted_tokens,
               "acceptance": m.num_accepted_tokens / m.num_draft_tokens if m.num_draft_tokens else None,
               "tokens_per_step": args.tokens / steps, "draft_ms_per_step": draft_ms,
               "plain_step_ms": plain_step_ms}
        rows.append(row)
        accept = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
        print(f"{name:<16}{seconds:>9.2f}{row['tokens_per_s']:>8.1f}{row['speedup']:>8.2f}x"
              f"{accept:>8}{row['tokens_per_step']:>9.2f}{draft_ms:>14.1f}"
              f"{draft_ms / plain_step_ms:>16.2f}x")
    same = len({tuple(o.outputs[0].token_ids) for o in outputs.values()}) == 1
    print(f"same greedy tokens in every engine: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_tokens": len(outputs["off"].prompt_token_ids),
                       "output_tokens": args.tokens, "same_tokens": same, "rows": rows}, f,
                      indent=2)


def _draft_stats(llm: LLM) -> tuple[int, float]:
    """(propose() calls, seconds in them) of the engine's draft proposer, (0, 0) without."""
    stats = getattr(llm.engine.scheduler.proposer, "stats", None)
    return (stats.num_calls, stats.seconds) if stats is not None else (0, 0.0)


def _minus(a: tuple[int, float], b: tuple[int, float]) -> tuple[int, float]:
    return a[0] - b[0], a[1] - b[1]


if __name__ == "__main__":
    main()
