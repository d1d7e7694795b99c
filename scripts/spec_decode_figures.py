"""Single-stream speed with and without n-gram speculative decoding on the bundled
SmolLM2: a "rewrite this code with one change" prompt holding a 40-line function, whose
answer mostly copies its input (the case prompt lookup is for). Greedy; the two engines
run alternately in one process and the median of the runs is kept; timings on a shared
machine are noisy, so compare the figures of one run side by side.

Usage: python scripts/spec_decode_figures.py [--k 4] [--tokens 200] [--runs 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedllm import LLM, SamplingParams

FUNCTION = '''def summarize(records, key, threshold=0.0, weights=None):
    """Group records by key and report count, total, mean and the largest value."""
    groups = {}
    for record in records:
        name = record.get(key)
        if name is None:
            continue
        value = float(record.get("value", 0.0))
        if value < threshold:
            continue
        weight = 1.0 if weights is None else weights.get(name, 1.0)
        group = groups.setdefault(name, {"count": 0, "total": 0.0, "largest": None})
        group["count"] += 1
        group["total"] += value * weight
        if group["largest"] is None or value > group["largest"]:
            group["largest"] = value
    report = []
    for name, group in sorted(groups.items()):
        count = group["count"]
        total = group["total"]
        mean = total / count if count else 0.0
        report.append({
            "name": name,
            "count": count,
            "total": round(total, 3),
            "mean": round(mean, 3),
            "largest": group["largest"],
        })
    report.sort(key=lambda row: row["total"], reverse=True)
    if not report:
        return []
    best = report[0]["total"]
    for row in report:
        if best:
            row["share"] = round(row["total"] / best, 3)
        else:
            row["share"] = 0.0
    return report
'''
PROMPT = ("Rewrite this Python function with one change: rename the parameter `records` to "
          "`rows` everywhere. Answer with the whole function only.\n\n" + FUNCTION
          + "\nRewritten function:\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=200, help="output tokens (EOS ignored)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    engines = {"off": LLM(), f"ngram k={args.k}": LLM(speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.runs):
        for name, llm in engines.items():
            t = time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)[0]
            times[name].append(time.perf_counter() - t)
            outputs[name] = out
    base = statistics.median(times["off"])
    rows = []
    print(f"{'speculation':<14}{'median s':>10}{'tok/s':>8}{'speedup':>9}{'drafted':>9}"
          f"{'accepted':>10}")
    for name, ts in times.items():
        m = outputs[name].metrics
        seconds = statistics.median(ts)
        row = {"speculation": name, "seconds": seconds, "runs": ts,
               "tokens_per_s": args.tokens / seconds, "speedup": base / seconds,
               "num_draft_tokens": m.num_draft_tokens, "num_accepted_tokens": m.num_accepted_tokens}
        rows.append(row)
        print(f"{name:<14}{seconds:>10.2f}{row['tokens_per_s']:>8.1f}{row['speedup']:>8.2f}x"
              f"{m.num_draft_tokens:>9}{m.num_accepted_tokens:>10}")
    same = len({tuple(o.outputs[0].token_ids) for o in outputs.values()}) == 1
    print(f"same greedy tokens with and without speculation: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_tokens": len(outputs["off"].prompt_token_ids),
                       "output_tokens": args.tokens, "same_tokens": same, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
